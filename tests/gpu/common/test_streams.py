"""Events on the caller's framework stream, on the GPU: ``async_finish`` calls made inside a torch stream context
(``with torch.cuda.stream(s):``) or a CuPy one, with the communication stream held back by a ~50 ms spin kernel
queued before the call, then ``event.current_stream_wait()`` and an immediate read of the output on ``s``. The read
sees the right rows only if the event made ``s`` itself wait (an event waited on by another stream, such as CuPy's
default one under torch, lets the read run before the kernels). The same with ``previous_event=Buffer.capture()``
after a slow producer on ``s``: the call must read what ``s`` wrote."""
from __future__ import annotations

import numpy as np
import pytest

import cupy_ep
from tests.helpers import all_ok, make_inputs, random_bf16, reference_combine, reference_dispatch, same_bytes

SPIN_NS = 50_000_000  # how long the spin kernel holds its stream: far longer than the calls and the host's reads
HIDDEN, TOKENS, TOPK, EXPERTS_PER_RANK = 2048, 256, 4, 8
TRIALS = 3            # fresh inputs each time: a read that ran too early sees the previous trial's rows


def _spin(stream_ptr: int, device_id: int) -> None:
    """Queue a kernel that keeps the stream ``stream_ptr`` busy for SPIN_NS."""
    import cupy

    from cupy_ep import interop, jit
    with cupy.cuda.Device(device_id):
        jit.get_kernel("probes/timing.cu", "ep::spin_ns")((1,), (1,), (np.int64(SPIN_NS),),
                                                    stream=interop.cupy_stream(stream_ptr, device_id))


class Framework:
    """The arrays, streams and host reads of one framework (torch or CuPy) on the buffer's GPU."""

    def __init__(self, name: str, device_id: int):
        import cupy
        self.name, self.device_id = name, device_id
        if name == "torch":
            torch = pytest.importorskip("torch")
            if not torch.cuda.is_available():
                pytest.skip("torch has no CUDA here")
            self.torch = torch
            self.device = torch.device("cuda", device_id)
            torch.cuda.set_device(self.device)
            self.stream = torch.cuda.Stream(self.device)
            self.stream_ptr = self.stream.cuda_stream
        else:
            with cupy.cuda.Device(device_id):
                self.stream = cupy.cuda.Stream(non_blocking=True)
            self.stream_ptr = self.stream.ptr

    def enter(self):
        """The context that makes the side stream current."""
        return self.torch.cuda.stream(self.stream) if self.name == "torch" else self.stream

    def array(self, a: np.ndarray):
        """``a`` on the GPU (bf16 stays bf16), ready (the copy finished)."""
        import cupy
        if self.name == "torch":
            torch = self.torch
            if a.dtype == cupy_ep.interop.BF16:
                t = torch.from_numpy(a.view(np.int16)).to(self.device).view(torch.bfloat16)
            else:
                t = torch.from_numpy(a).to(self.device)
            torch.cuda.synchronize(self.device)
            return t
        with cupy.cuda.Device(self.device_id):
            out = (cupy.asarray(a.view(np.uint16)).view(cupy_ep.interop.BF16) if a.dtype == cupy_ep.interop.BF16
                   else cupy.asarray(a))
            cupy.cuda.Device().synchronize()
        return out

    def zeros_like(self, a):
        """Zeros shaped and typed as ``a`` (bf16), written on the current stream."""
        if self.name == "torch":
            return self.torch.zeros_like(a)
        import cupy
        return cupy.zeros(a.shape, dtype=cupy.uint16).view(a.dtype)

    def copy_into(self, dst, src) -> None:
        """``dst[...] = src`` (bf16) on the current stream."""
        if self.name == "torch":
            dst.copy_(src)
        else:
            import cupy
            dst.view(cupy.uint16)[...] = src.view(cupy.uint16)

    def read(self, a) -> np.ndarray:
        """``a``'s values on the host, copied on the *current* stream (ordered after what that stream waits for)."""
        if self.name == "torch":
            from cupy_ep import interop
            raw = interop.unwrap(a.cpu())  # .cpu() copies on torch's current stream and waits for it
            return raw.view(cupy_ep.interop.BF16) if a.dtype == self.torch.bfloat16 else raw
        import cupy
        stream = cupy.cuda.get_current_stream()
        host = a.get(stream=stream)
        stream.synchronize()
        return host


@pytest.fixture(params=["torch", "cupy"])
def framework(request, gpu_buffer):
    return Framework(request.param, gpu_buffer.device_id)


def _routing(comm, buf, fw: Framework, rng):
    """A synchronous dispatch on the default stream: the handle the timed calls reuse, and the reference rows."""
    R = comm.Get_size()
    num_experts = EXPERTS_PER_RANK * R
    inp = make_inputs(rng, TOKENS, HIDDEN, TOPK, num_experts, R)
    idx, w = fw.array(inp.topk_idx), fw.array(inp.topk_weights)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
    x = fw.array(inp.x)
    *_, handle, event = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                     num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    assert event.event is None
    ref = reference_dispatch(comm, inp.x, inp.topk_idx, inp.topk_weights, num_experts)
    return inp, handle, ref, num_experts


@pytest.mark.mpi(min_size=2)
def test_async_events_make_the_callers_stream_wait(comm, gpu_buffer, framework):
    """Cached dispatch and combine with async_finish inside the framework's stream context, the comm stream held
    back: the output read on that stream right after ``event.current_stream_wait()`` holds the right rows."""
    fw, buf, rank = framework, gpu_buffer, comm.Get_rank()
    rng = np.random.default_rng(91 + rank)
    errors: list[str] = []
    inp, handle, ref, num_experts = _routing(comm, buf, fw, rng)
    comm_stream = buf.get_comm_stream()
    if fw.name == "torch":
        if not isinstance(comm_stream, fw.torch.cuda.Stream) or comm_stream.cuda_stream != buf.comm_stream.ptr:
            errors.append(f"get_comm_stream for torch users: {comm_stream!r}")
    elif comm_stream is not buf.comm_stream:
        errors.append(f"get_comm_stream for CuPy users: {comm_stream!r}")
    for trial in range(TRIALS):
        x_np = random_bf16(rng, (TOKENS, HIDDEN))
        want_rows = reference_dispatch(comm, x_np, inp.topk_idx, inp.topk_weights, num_experts).recv_x
        y_np = random_bf16(rng, (want_rows.shape[0], HIDDEN))
        want_combined, _ = reference_combine(comm, y_np, ref.is_token_in_rank)
        x, y = fw.array(x_np), fw.array(y_np)
        comm.Barrier()
        with fw.enter():
            _spin(buf.comm_stream.ptr, buf.device_id)
            recv_x, *_, event = buf.dispatch(x, handle=handle, async_finish=True)
            event.current_stream_wait()
            got_rows = fw.read(recv_x)
            _spin(buf.comm_stream.ptr, buf.device_id)
            combined, _, event = buf.combine(y, handle, async_finish=True)
            with event:  # the context manager waits at its end
                pass
            got_combined = fw.read(combined)
        if not same_bytes(got_rows, want_rows):
            errors.append(f"trial {trial}: recv_x read on the caller's stream after current_stream_wait differs")
        if not same_bytes(got_combined, want_combined):
            errors.append(f"trial {trial}: combined_x read on the caller's stream after `with event` differs")
    assert all_ok(comm, not errors), f"rank {rank} ({fw.name}): {errors}"


@pytest.mark.mpi(min_size=2)
def test_capture_records_the_callers_stream(comm, gpu_buffer, framework):
    """``previous_event=Buffer.capture()`` after a slow producer on the framework's stream: the call (which waits
    for that event instead of the stream) reads what the producer wrote."""
    fw, buf, rank = framework, gpu_buffer, comm.Get_rank()
    rng = np.random.default_rng(57 + rank)
    errors: list[str] = []
    inp, handle, _, num_experts = _routing(comm, buf, fw, rng)
    for trial in range(TRIALS):
        x_np = random_bf16(rng, (TOKENS, HIDDEN))
        want_rows = reference_dispatch(comm, x_np, inp.topk_idx, inp.topk_weights, num_experts).recv_x
        x_src = fw.array(x_np)
        comm.Barrier()
        with fw.enter():
            x = fw.zeros_like(x_src)
            _spin(fw.stream_ptr, buf.device_id)  # the producer: x is written SPIN_NS from now, on this stream
            fw.copy_into(x, x_src)
            previous = cupy_ep.Buffer.capture()
            recv_x, *_, event = buf.dispatch(x, handle=handle, previous_event=previous, async_finish=True)
            event.current_stream_wait()
            got_rows = fw.read(recv_x)
        if not same_bytes(got_rows, want_rows):
            errors.append(f"trial {trial}: the dispatch did not wait for the work captured on the caller's stream")
    assert all_ok(comm, not errors), f"rank {rank} ({fw.name}): {errors}"
