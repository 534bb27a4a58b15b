"""cupy_ep.preinit: which GPU the background CUDA start picks, and that it is harmless without a driver."""
import ctypes

import pytest

from cupy_ep import preinit


@pytest.fixture
def clean_env(monkeypatch):
    for name in preinit._LOCAL_RANK_VARS + ("CUPY_EP_DEVICE",):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("var", preinit._LOCAL_RANK_VARS)
def test_local_rank_from_each_launcher(clean_env, var):
    clean_env.setenv(var, "3")
    assert preinit.local_rank() == 3
    assert preinit.wanted_device() == (3, True)


def test_no_launcher_means_driver_only(clean_env):
    assert preinit.local_rank() is None
    assert preinit.wanted_device() == (None, False)


def test_explicit_device_wins_and_is_not_wrapped(clean_env):
    clean_env.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    clean_env.setenv("CUPY_EP_DEVICE", "5")
    assert preinit.wanted_device() == (5, False)
    clean_env.setenv("CUPY_EP_DEVICE", "x")
    assert preinit.wanted_device() == (None, False)


class FakeDriver:
    """The five driver entry points preinit calls, recording the device whose context was retained."""

    def __init__(self, count):
        self.count, self.retained = count, None

    def cuInit(self, flags):
        return 0

    def cuDeviceGetCount(self, out):
        out._obj.value = self.count
        return 0

    def cuDeviceGet(self, out, ordinal):
        out._obj.value = 100 + ordinal
        return 0

    def cuDevicePrimaryCtxRetain(self, out, handle):
        self.retained = handle.value
        return 0


@pytest.mark.parametrize("device,modulo,count,want,retained", [
    (3, True, 2, "context 1", 101),          # local rank 3 on 2 GPUs -> GPU 1 (as choose_device)
    (0, True, 8, "context 0", 100),
    (5, False, 2, "no such device", None),   # CUPY_EP_DEVICE out of range: choose_device will raise; no context
    (None, False, 2, "driver only", None),   # no local rank: cuInit only
])
def test_run_picks_the_device_choose_device_picks(monkeypatch, device, modulo, count, want, retained):
    fake = FakeDriver(count)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: fake)
    monkeypatch.setattr(preinit, "status", "not started")
    preinit._run(device, modulo)
    assert preinit.status == want
    assert fake.retained == retained


def test_no_driver_is_quiet(monkeypatch):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(ctypes, "CDLL", missing)
    monkeypatch.setattr(preinit, "status", "not started")
    preinit._run(0, True)
    assert preinit.status == "no driver"


def test_import_started_it_once():
    # cupy_ep's import started the thread (or recorded "off"); join returns a final status either way
    final = preinit.join()
    assert final != "not started"
    thread = preinit._thread
    preinit.start()
    assert preinit._thread is thread
