"""Config validation, DeepEP's default tables, buffer-size arithmetic and tuned-config loading."""
from __future__ import annotations

import dataclasses
import json

import pytest

from cupy_ep import Buffer, Config
from cupy_ep import config as cfg
from cupy_ep.config import internode_buffer_bytes


@pytest.fixture
def restore_num_sms():
    saved = Buffer.num_sms
    yield
    Buffer.num_sms = saved


@pytest.fixture
def no_tuned_file(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPY_EP_TUNED_CONFIG", str(tmp_path / "absent.json"))


# ---- Config ------------------------------------------------------------------------------------------
def test_config_defaults():
    c = Config()
    assert dataclasses.astuple(c) == (20, 6, 256, 6, 256)
    assert c.num_channels == 10
    assert Config(num_sms=2).num_channels == 1


@pytest.mark.parametrize("kwargs, exc, field", [
    (dict(num_sms=3), ValueError, "Config.num_sms"),
    (dict(num_sms=0), ValueError, "Config.num_sms"),
    (dict(num_sms=-2), ValueError, "Config.num_sms"),
    (dict(num_sms=20.0), TypeError, "Config.num_sms"),
    (dict(num_sms=True), TypeError, "Config.num_sms"),
    (dict(num_max_nvl_chunked_send_tokens=0), ValueError, "Config.num_max_nvl_chunked_send_tokens"),
    (dict(num_max_nvl_chunked_send_tokens="6"), TypeError, "Config.num_max_nvl_chunked_send_tokens"),
    (dict(num_max_nvl_chunked_recv_tokens=6), ValueError, "Config.num_max_nvl_chunked_recv_tokens"),
    (dict(num_max_rdma_chunked_send_tokens=0), ValueError, "Config.num_max_rdma_chunked_send_tokens"),
    (dict(num_max_rdma_chunked_recv_tokens=11), ValueError, "Config.num_max_rdma_chunked_recv_tokens"),
    (dict(num_max_rdma_chunked_recv_tokens=None), TypeError, "Config.num_max_rdma_chunked_recv_tokens"),
])
def test_config_rejects(kwargs, exc, field):
    with pytest.raises(exc, match=field.replace(".", r"\.")):
        Config(**kwargs)


def test_config_edge_values_accepted():
    Config(num_sms=2, num_max_nvl_chunked_send_tokens=1, num_max_nvl_chunked_recv_tokens=2,
           num_max_rdma_chunked_send_tokens=3, num_max_rdma_chunked_recv_tokens=6)


# ---- default tables ----------------------------------------------------------------------------------
@pytest.mark.parametrize("num_ranks, dispatch, combine", [
    (2, (24, 256, 6, 128), (48, 256, 6, 128)),
    (4, (6, 256, 6, 128), (24, 256, 6, 128)),
    (8, (6, 256, 6, 128), (6, 256, 6, 128)),
    (3, (6, 256, 6, 128), (24, 256, 6, 128)),     # odd counts take the next tabulated one
    (5, (6, 256, 6, 128), (6, 256, 6, 128)),
    (7, (6, 256, 6, 128), (6, 256, 6, 128)),
])
def test_default_tables(num_ranks, dispatch, combine, no_tuned_file):
    assert dataclasses.astuple(cfg.get_dispatch_config(num_ranks, 24)) == (24,) + dispatch
    assert dataclasses.astuple(cfg.get_combine_config(num_ranks, 24)) == (24,) + combine


@pytest.mark.parametrize("num_ranks", [0, 1])
def test_default_tables_reject_unsupported_rank_counts(num_ranks):
    with pytest.raises(ValueError, match="num_ranks"):
        cfg.get_dispatch_config(num_ranks, 20)
    with pytest.raises(ValueError, match="num_ranks"):
        cfg.get_combine_config(num_ranks, 20)


@pytest.mark.parametrize("num_ranks, tabulated", [(16, 16), (9, 16), (40, 48), (160, 160), (256, 160)])
def test_default_tables_above_one_node_are_deepeps_internode_table(num_ranks, tabulated, no_tuned_file):
    d, c = cfg.get_dispatch_config(num_ranks, 24), cfg.get_combine_config(num_ranks, 24)
    assert d == Config(24, *cfg._DEFAULT_INTERNODE_DISPATCH[tabulated])
    assert c == Config(24, *cfg._DEFAULT_INTERNODE_COMBINE[tabulated])
    assert cfg.get_dispatch_config(16, 24) == Config(24, 36, 288, 20, 128)   # DeepEP's table
    assert cfg.get_combine_config(16, 24) == Config(24, 4, 288, 12, 128)


def test_buffer_configs_follow_set_num_sms(restore_num_sms, no_tuned_file):
    assert Buffer.get_dispatch_config(4).num_sms == Buffer.num_sms == 20
    Buffer.set_num_sms(24)
    assert Buffer.num_sms == 24
    assert Buffer.get_dispatch_config(4).num_sms == 24 and Buffer.get_combine_config(8).num_channels == 12


@pytest.mark.parametrize("bad", [3, 0, 1, -2, 24.0, "24", None])
def test_set_num_sms_rejects(bad, restore_num_sms):
    with pytest.raises(ValueError, match="new_num_sms"):
        Buffer.set_num_sms(bad)
    assert Buffer.num_sms == 20


# ---- size hints --------------------------------------------------------------------------------------
def test_size_hint_literal_deepseek_v3_shape(no_tuned_file):
    # R=8, H=7168 bf16, num_sms=20 (10 channels), 256 slots, 56 scales, top-k 32:
    # dispatch carve = 4*384 + 80*256*14336 + 80*256*4 + 2*80*256*32*4 + 80*256*56*4 = 303,515,136
    # combine carve  = 2*384 + 80*256*14336 + 80*256*32*4                          = 296,223,488
    # NOTIFY_BYTES = (8*8 rank matrix + 8*1024 expert counts + 8*8 call words) * 4
    #                + align128(8 token counts * 4)                                = 33,408
    #                + the zero-copy entry handshake: align128(8 entries * 4) 128
    #                  + 2*8*8 entry words * 4 = 512 + epoch 128 + arrivals 128     = 34,304
    # hint = align128(NOTIFY_BYTES 34,304 + 303,515,136)                            = 303,549,440
    assert cfg.NOTIFY_BYTES == 34304
    assert cfg.dispatch_channel_bytes(10, 8, 256, 14336, 32, 56) == 303_515_136
    assert cfg.combine_channel_bytes(10, 8, 256, 14336, 32) == 296_223_488
    assert Config().get_nvl_buffer_size_hint(14336, 8) == 303_549_440
    assert Buffer.get_nvl_buffer_size_hint(14336, 8) == 303_549_440


@pytest.mark.parametrize("num_sms, recv_tokens", [(2, 7), (20, 256), (24, 512), (32, 100)])
@pytest.mark.parametrize("num_ranks", [2, 3, 4, 8])
@pytest.mark.parametrize("hidden_bytes", [16, 32, 4096, 14336, 14352, 65536])
def test_size_hint_is_the_carve_sum(num_sms, recv_tokens, num_ranks, hidden_bytes):
    c = Config(num_sms=num_sms, num_max_nvl_chunked_send_tokens=1, num_max_nvl_chunked_recv_tokens=recv_tokens)
    scales = -(-(hidden_bytes // 2) // 128)
    want = max(cfg.dispatch_channel_bytes(c.num_channels, num_ranks, recv_tokens, hidden_bytes, cfg.MAX_TOPK, scales),
               cfg.combine_channel_bytes(c.num_channels, num_ranks, recv_tokens, hidden_bytes, cfg.MAX_TOPK))
    hint = c.get_nvl_buffer_size_hint(hidden_bytes, num_ranks)
    assert hint % 128 == 0
    assert hint == cfg.align_up(want + cfg.NOTIFY_BYTES)


def test_carve_arrays_are_128_aligned():
    # one int per (channel, rank): 1*3*4 = 12 bytes -> one 128-byte array each
    assert cfg.combine_channel_bytes(1, 3, 1, 16, 1) == 2 * 128 + 128 + 128
    assert cfg.dispatch_channel_bytes(1, 3, 1, 16, 1, 1) == 4 * 128 + 128 + 128 + 2 * 128 + 128


def test_size_hint_monotone_in_hidden_and_ranks(no_tuned_file):
    hiddens = [16, 256, 2048, 4096, 7168 * 2, 16384, 65536]
    for num_ranks in (2, 4, 8):
        hints = [Buffer.get_nvl_buffer_size_hint(h, num_ranks) for h in hiddens]
        assert all(a < b for a, b in zip(hints, hints[1:])), hints
    for hidden_bytes in hiddens:
        c = Config()
        hints = [c.get_nvl_buffer_size_hint(hidden_bytes, r) for r in range(2, 9)]
        assert all(a < b for a, b in zip(hints, hints[1:])), hints
        # above one NVLink domain the intranode part stops growing (the internode NVLink buffer may need more)
        assert c.get_nvl_buffer_size_hint(hidden_bytes, 16) >= hints[-1]
        assert c.get_nvl_buffer_size_hint(hidden_bytes, 16) == max(
            hints[-1], internode_buffer_bytes(2, 8, hidden_bytes, c)[0])


def test_size_hint_grows_with_num_sms(restore_num_sms, no_tuned_file):
    small = Buffer.get_nvl_buffer_size_hint(4096, 4)
    Buffer.set_num_sms(24)
    assert Buffer.get_nvl_buffer_size_hint(4096, 4) > small


def test_rdma_hint_is_zero_within_one_domain():
    assert Config().get_rdma_buffer_size_hint(14336, 8) == 0
    # above: the RDMA half of the internode size model, nodes of 8 GPUs (DeepEP's assumption)
    assert Config().get_rdma_buffer_size_hint(14336, 16) == internode_buffer_bytes(2, 8, 14336, Config())[1] > 0


# ---- tuned configs -----------------------------------------------------------------------------------
def test_tuned_config_is_picked_up(tmp_path, monkeypatch):
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({
        "dispatch/4/14336": {"num_sms": 24, "num_max_nvl_chunked_send_tokens": 8,
                             "num_max_nvl_chunked_recv_tokens": 512},
        "combine/4/14336": {"num_sms": 32, "num_max_nvl_chunked_send_tokens": 3,
                            "num_max_nvl_chunked_recv_tokens": 128},
    }))
    monkeypatch.setenv("CUPY_EP_TUNED_CONFIG", str(path))
    assert cfg.tuned_config_path() == path
    assert Buffer.get_dispatch_config(4, hidden_bytes=14336) == Config(24, 8, 512)
    assert Buffer.get_combine_config(4, hidden_bytes=14336) == Config(32, 3, 128)
    # other shapes, and calls without a hidden size, keep the defaults
    assert Buffer.get_dispatch_config(4, hidden_bytes=7168) == Config(Buffer.num_sms, 6, 256, 6, 128)
    assert Buffer.get_dispatch_config(2, hidden_bytes=14336) == Config(Buffer.num_sms, 24, 256, 6, 128)
    assert Buffer.get_dispatch_config(4) == Config(Buffer.num_sms, 6, 256, 6, 128)
    # the size hint follows the tuned configs (the larger of the two)
    want = max(Config(24, 8, 512).get_nvl_buffer_size_hint(14336, 4),
               Config(32, 3, 128).get_nvl_buffer_size_hint(14336, 4))
    assert Buffer.get_nvl_buffer_size_hint(14336, 4) == want


def test_unreadable_tuned_file_falls_back_to_defaults(tmp_path, monkeypatch):
    path = tmp_path / "tuned.json"
    path.write_text("{not json")
    monkeypatch.setenv("CUPY_EP_TUNED_CONFIG", str(path))
    assert Buffer.get_dispatch_config(4, hidden_bytes=14336) == Config(Buffer.num_sms, 6, 256, 6, 128)


def test_tuned_config_path_default_location(monkeypatch, tmp_path):
    monkeypatch.delenv("CUPY_EP_TUNED_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cfg.tuned_config_path() == tmp_path / "cupy_ep" / "tuned_configs.json"


# ---- intranode dispatch split --------------------------------------------------------------------------
@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("num_sms", [4, 6, 8, 12, 16, 20, 24, 32, 48, 132])
def test_dispatch_split_uses_every_sm(num_sms, num_ranks):
    channels, own = Config(num_sms=num_sms).intranode_dispatch_split(num_ranks)
    assert 2 * channels + own == num_sms and channels >= 1 and own >= 1
    assert Config(num_sms=num_sms).intranode_dispatch_channels(num_ranks) == channels


def test_dispatch_split_at_ep2_is_3_3_2():
    # senders : ring receivers : own-row SMs as measured best
    got = {n: Config(num_sms=n).intranode_dispatch_split(2) for n in (8, 16, 24, 32)}
    assert got == {8: (3, 2), 16: (6, 4), 24: (9, 6), 32: (12, 8)}


def test_dispatch_split_gives_own_rows_less_with_more_ranks():
    # the own rows are 1/R of what a rank receives: fewer own-row SMs at 8 ranks than at 2
    assert Config(num_sms=24).intranode_dispatch_split(8)[1] < Config(num_sms=24).intranode_dispatch_split(2)[1]


def test_dispatch_split_needs_four_sms():
    with pytest.raises(ValueError, match="config: an intranode dispatch needs num_sms >= 4"):
        Config(num_sms=2).intranode_dispatch_split(2)
    assert Config(num_sms=2).num_channels == 1  # a combine (or internode) on 2 SMs is fine


def test_a_rewritten_or_removed_tuned_file_is_read_again(tmp_path, monkeypatch):
    """The file's entries are kept between calls (every default-config call looks them up) but re-read when the
    tuner rewrites the file, and forgotten when it is removed."""
    path = tmp_path / "tuned.json"
    monkeypatch.setenv("CUPY_EP_TUNED_CONFIG", str(path))
    entry = {"num_max_nvl_chunked_send_tokens": 8, "num_max_nvl_chunked_recv_tokens": 512}
    path.write_text(json.dumps({"dispatch/4/14336": {"num_sms": 24, **entry}}))
    assert Buffer.get_dispatch_config(4, hidden_bytes=14336) == Config(24, 8, 512)
    path.write_text(json.dumps({"dispatch/4/14336": {"num_sms": 128, **entry}}))   # the size changes too
    assert Buffer.get_dispatch_config(4, hidden_bytes=14336) == Config(128, 8, 512)
    path.unlink()
    assert Buffer.get_dispatch_config(4, hidden_bytes=14336) == Config(Buffer.num_sms, 6, 256, 6, 128)
