"""Could the copy engines carry the normal-mode combine (issue 4: combine >= 0.90 of the ceiling, now 0.78)?
Not run yet: prepared in session 17 for the next device session (2 GPUs: mpirun -n 2).

The model: at EP2 with the default workload nearly every token has rows on both ranks, so each rank sends one
bf16 row per peer token back to its owner (4096 x 14336 B = 58.7 MB per direction) and each owner adds that row
to its own. Here the transfer is cudaMemcpyAsync into the peer's memory (CUDA IPC) in K chunks spread over S
streams, each chunk followed by a flag (the call's epoch) written into the peer's memory: a stream memory op
(cuStreamWriteValue32, which fences the stream's earlier writes first) or a one-thread kernel (st.release.sys).
The owner's reduce kernel (B blocks, launched first on its own stream) sums each chunk's rows as soon as its flag
is in, so the reduction hides behind the copies but the last chunk's.

Printed per variant: the median time of the whole combine (slowest rank), its GB/s per direction, and the same for
the copies alone and for the reduce alone (flags preset). For comparison (session 15, same machine): the
zero-copy SM combine 206 us at 24 SMs; the copy ceiling 363.6 GB/s steady (161 us for these bytes); 0.90 of it is
179 us. One copy of all 58.7 MB measured 370 GB/s per direction in S12I (`benchmarks/experiments/s12/exp_ce.py`).

    mpirun -n 2 python3 benchmarks/experiments/s17/ce_combine_probe.py
"""
from __future__ import annotations

import ctypes
import itertools

import cupy
import numpy as np
from mpi4py import MPI

TOKENS, HIDDEN = 4096, 7168
ROW_BYTES = HIDDEN * 2
ITERS, WARMUP = 20, 3

SOURCE = r"""
__device__ __forceinline__ int ld_acquire_sys(const int* p) {
    int v; asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}
__device__ __forceinline__ float bf16_to_float(unsigned short u) { return __uint_as_float((unsigned)u << 16); }
__device__ __forceinline__ unsigned short float_to_bf16(float f) {  // round to nearest even (finite inputs)
    const unsigned u = __float_as_uint(f);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
// out[t] = own[t] + recv[t] (bf16 rows, fp32 sum), rows in chunks of rows_per_chunk; a chunk's rows are read once
// flags[chunk] == epoch. Blocks take rows round robin in chunk order, so early chunks are summed first.
extern "C" __global__ void __launch_bounds__(512, 1)
reduce(const uint4* own, const uint4* recv, uint4* out, const int* flags, int epoch, int rows, int rows_per_chunk,
       int row_uint4, int* timeouts) {
    __shared__ int ready_chunk;
    if (threadIdx.x == 0) ready_chunk = -1;
    __syncthreads();
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        const int chunk = row / rows_per_chunk;
        if (chunk != ready_chunk) {
            if (threadIdx.x == 0) {
                const unsigned long long t0 = now_ns();
                while (ld_acquire_sys(flags + chunk) != epoch) {
                    if (now_ns() - t0 > 2000000000ull) { atomicAdd(timeouts, 1); break; }  // 2 s: never hang
                }
                ready_chunk = chunk;
            }
            __syncthreads();
        }
        for (int i = threadIdx.x; i < row_uint4; i += blockDim.x) {
            const uint4 a = own[(long long)row * row_uint4 + i], b = recv[(long long)row * row_uint4 + i];
            const unsigned* pa = reinterpret_cast<const unsigned*>(&a);
            const unsigned* pb = reinterpret_cast<const unsigned*>(&b);
            uint4 c;
            unsigned* pc = reinterpret_cast<unsigned*>(&c);
            for (int k = 0; k < 4; ++k) {
                const float lo = bf16_to_float(pa[k] & 0xffff) + bf16_to_float(pb[k] & 0xffff);
                const float hi = bf16_to_float(pa[k] >> 16) + bf16_to_float(pb[k] >> 16);
                pc[k] = (unsigned)float_to_bf16(lo) | ((unsigned)float_to_bf16(hi) << 16);
            }
            out[(long long)row * row_uint4 + i] = c;
        }
    }
}
extern "C" __global__ void flag(int* peer_flag, int epoch) {
    asm volatile("st.release.sys.global.b32 [%0], %1;" :: "l"(peer_flag), "r"(epoch) : "memory");
}
"""


def bf16_sum_reference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The kernel's bf16 + bf16 -> bf16 (fp32 sum, round to nearest even), on uint16 bit patterns."""
    f = (a.astype(np.uint32) << 16).view(np.float32) + (b.astype(np.uint32) << 16).view(np.float32)
    u = f.view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


class Probe:
    def __init__(self, comm):
        self.comm, self.rank = comm, comm.Get_rank()
        self.peer = 1 - self.rank
        cupy.cuda.Device(self.rank % cupy.cuda.runtime.getDeviceCount()).use()
        rng = np.random.default_rng(7 + self.rank)
        # finite bf16 patterns of moderate magnitude: exponent 120..134, random sign and mantissa
        def rows():
            e = rng.integers(120, 135, size=(TOKENS, HIDDEN), dtype=np.uint16)
            m = rng.integers(0, 128, size=(TOKENS, HIDDEN), dtype=np.uint16)
            s = rng.integers(0, 2, size=(TOKENS, HIDDEN), dtype=np.uint16)
            return (s << 15) | (e << 7) | m
        self.own_np, self.to_peer_np = rows(), rows()
        self.own, self.to_peer = cupy.asarray(self.own_np), cupy.asarray(self.to_peer_np)
        self.recv = cupy.zeros((TOKENS, HIDDEN), dtype=cupy.uint16)
        self.out = cupy.zeros((TOKENS, HIDDEN), dtype=cupy.uint16)
        self.flags = cupy.zeros(64, dtype=cupy.int32)
        self.timeouts = cupy.zeros(1, dtype=cupy.int32)  # reduce blocks that gave up waiting for a flag
        handles = comm.allgather((cupy.cuda.runtime.ipcGetMemHandle(self.recv.data.ptr),
                                  cupy.cuda.runtime.ipcGetMemHandle(self.flags.data.ptr)))
        self.peer_recv = cupy.cuda.runtime.ipcOpenMemHandle(handles[self.peer][0])
        self.peer_flags = cupy.cuda.runtime.ipcOpenMemHandle(handles[self.peer][1])
        module = cupy.RawModule(code=SOURCE, options=("-std=c++17",))
        self.reduce_k, self.flag_k = module.get_function("reduce"), module.get_function("flag")
        self.main = cupy.cuda.Stream(non_blocking=True)
        self.reduce_stream = cupy.cuda.Stream(non_blocking=True)
        self.copy_streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(4)]
        self.epoch = 0
        lib = ctypes.CDLL("libcuda.so.1")
        self.write_value = lib.cuStreamWriteValue32_v2
        self.write_value.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_uint, ctypes.c_uint]
        self.write_value.restype = ctypes.c_int

    def issue(self, chunks: int, streams: int, blocks: int, flag_mode: str, copies: bool, reduce: bool):
        """One combine: the copies and flags to the peer, the reduce of what the peer sends here."""
        self.epoch += 1
        start = self.main.record()
        rows_per_chunk = -(-TOKENS // chunks)
        if reduce:
            self.reduce_stream.wait_event(start)
            if not copies:  # the reduce alone: every chunk already "in"
                with self.reduce_stream:
                    self.flags.fill(np.int32(self.epoch))
            with self.reduce_stream:  # (RawKernel launches on the current stream)
                self.reduce_k((blocks,), (512,), (self.own, self.recv, self.out, self.flags, np.int32(self.epoch),
                                                 np.int32(TOKENS), np.int32(rows_per_chunk), np.int32(ROW_BYTES // 16),
                                                 self.timeouts))
        used = self.copy_streams[:streams]
        for s in used:
            s.wait_event(start)
        for c in range(chunks):
            lo, hi = c * rows_per_chunk, min(TOKENS, (c + 1) * rows_per_chunk)
            s = used[c % streams]
            if copies:
                cupy.cuda.runtime.memcpyAsync(self.peer_recv + lo * ROW_BYTES, self.to_peer.data.ptr + lo * ROW_BYTES,
                                              (hi - lo) * ROW_BYTES, cupy.cuda.runtime.memcpyDeviceToDevice, s.ptr)
            if not copies:
                continue
            if flag_mode == "memop":
                rc = self.write_value(s.ptr, self.peer_flags + 4 * c, self.epoch, 0)
                if rc != 0:
                    raise RuntimeError(f"cuStreamWriteValue32_v2 returned {rc}")
            else:
                with s:
                    self.flag_k((1,), (1,), (np.uint64(self.peer_flags + 4 * c), np.int32(self.epoch)))
        for s in used + ([self.reduce_stream] if reduce else []):
            self.main.wait_event(s.record())
        return start, self.main.record()

    def time(self, **variant) -> float:
        times = []
        for i in range(WARMUP + ITERS):
            cupy.cuda.runtime.deviceSynchronize()
            self.comm.Barrier()
            start, end = self.issue(**variant)
            end.synchronize()
            if i >= WARMUP:
                times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3)
        return max(self.comm.allgather(float(np.median(times))))

    def check(self, **variant) -> str:
        """The combine's output against numpy (own + what the peer sent): "" when right on both ranks, else why.
        Every rank returns the same answer (an error on one rank does not leave the other in a collective)."""
        self.out.fill(0)
        self.timeouts.fill(0)
        cupy.cuda.runtime.deviceSynchronize()
        self.comm.Barrier()
        try:
            self.issue(**variant)[1].synchronize()
            why = "" if int(self.timeouts.get()[0]) == 0 else "a reduce block timed out waiting for a flag"
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
        peer_rows = self.comm.sendrecv(self.to_peer_np, dest=self.peer, source=self.peer)
        if not why and not np.array_equal(self.out.get(), bf16_sum_reference(self.own_np, peer_rows)):
            why = "the output does not match the numpy reference"
        whys = self.comm.allgather(why)
        return "; ".join(f"rank {r}: {w}" for r, w in enumerate(whys) if w)


def main():
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 2:
        raise SystemExit("ce_combine_probe.py: run with mpirun -n 2 (one GPU per rank)")
    p = Probe(comm)
    nbytes = TOKENS * ROW_BYTES

    def report(name, us):
        if p.rank == 0:
            print(f"  {name:48s} {us:7.1f} us  {nbytes / us / 1e3:6.1f} GB/s per direction", flush=True)
    for blocks in (16, 32):
        report(f"reduce alone, {blocks} blocks", p.time(chunks=1, streams=1, blocks=blocks, flag_mode="memop",
                                                       copies=False, reduce=True))
    for flag_mode in ("memop", "kernel"):
        why = p.check(chunks=4, streams=2, blocks=32, flag_mode=flag_mode, copies=True, reduce=True)
        if p.rank == 0:
            print(f"flags by {flag_mode}: {'matches the numpy reference' if not why else 'FAILED: ' + why}", flush=True)
        if why:  # e.g. a memop on peer memory refused: try the other flag
            continue
        report(f"copies alone, 1 chunk ({flag_mode})", p.time(chunks=1, streams=1, blocks=32, flag_mode=flag_mode,
                                                           copies=True, reduce=False))
        for chunks, streams, blocks in itertools.product((1, 2, 4, 8, 16), (1, 2, 4), (16, 32)):
            if streams > chunks:
                continue
            us = p.time(chunks=chunks, streams=streams, blocks=blocks, flag_mode=flag_mode, copies=True, reduce=True)
            report(f"combine: {chunks:2d} chunks, {streams} streams, {blocks} blocks ({flag_mode})", us)
    cupy.cuda.runtime.deviceSynchronize()
    comm.Barrier()
    cupy.cuda.runtime.ipcCloseMemHandle(p.peer_recv)
    cupy.cuda.runtime.ipcCloseMemHandle(p.peer_flags)


if __name__ == "__main__":
    main()
