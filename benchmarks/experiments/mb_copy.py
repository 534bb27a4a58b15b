"""Single-GPU microbenchmark: per-SM GB/s of local row copies and 2-source reductions (see mb_copy.cu)."""
import os, sys
import numpy as np
import cupy
here = os.path.dirname(os.path.abspath(__file__))
src_dir = os.path.join(here, "..", "..", "cuda_src")
code = open(os.path.join(here, "mb_copy.cu")).read()
names = ["ep::copy_reg<4>", "ep::copy_reg<6>", "ep::copy_reg<8>", "ep::copy_tma_warp",
         "ep::copy_tma_pipe<1, 12>", "ep::copy_tma_pipe<2, 6>", "ep::copy_tma_pipe<4, 3>", "ep::copy_tma_pipe<4, 2>",
         "ep::reduce_reg<2>", "ep::reduce_reg<3>", "ep::reduce_reg<4>", "ep::reduce_tma_warp",
         "ep::reduce_tma_pipe<8, 3, 4096>", "ep::reduce_tma_pipe<12, 2, 4096>", "ep::reduce_tma_pipe<16, 3, 2048>",
         "ep::reduce_tma_pipe<24, 2, 2048>", "ep::reduce_tma_pipe<8, 4, 3072>", "ep::reduce_tma_pipe<4, 4, 7168>"]
mod = cupy.RawModule(code=code, options=("-std=c++17", f"-I{src_dir}"), name_expressions=names,
                     backend="nvrtc")
rows, row_int4 = 4096, 7168 * 2 // 16
a = cupy.random.randint(0, 1 << 16, size=rows * row_int4 * 8, dtype=cupy.uint16).view(cupy.uint16) & 0x3fff
b = cupy.random.randint(0, 1 << 16, size=rows * row_int4 * 8, dtype=cupy.uint16).view(cupy.uint16) & 0x3fff
dst = cupy.zeros_like(a)
flush = cupy.empty(256 << 20, dtype=cupy.uint8)
row_bytes = row_int4 * 16

def smem_of(name):
    if "copy_tma_warp" in name or "reduce_tma_warp" in name:
        return 24 * 8192
    if "copy_tma_pipe" in name:
        w, s = [int(v) for v in name.split("<")[1].rstrip(">").split(",")]
        return w * s * row_bytes
    if "reduce_tma_pipe" in name:
        w, s, c = [int(v) for v in name.split("<")[1].rstrip(">").split(",")]
        return w * s * 2 * c
    return 0

def threads_of(name):
    if "_pipe" in name:
        return int(name.split("<")[1].split(",")[0]) * 32
    return 768

def run(name, sms, iters=20):
    k = mod.get_function(name)
    smem = smem_of(name)
    if smem > 48 * 1024:
        k.max_dynamic_shared_size_bytes = smem
    args = (dst, a, rows, np.int32(row_int4)) if "copy" in name else (dst, a, b, rows, np.int32(row_int4))
    args = tuple(np.int32(v) if isinstance(v, int) else v for v in args)
    ts = []
    for i in range(iters + 3):
        flush.fill(i & 0xff)
        s, e = cupy.cuda.Event(), cupy.cuda.Event()
        s.record(); k((sms,), (threads_of(name),), args, shared_mem=smem); e.record(); e.synchronize()
        if i >= 3:
            ts.append(cupy.cuda.get_elapsed_time(s, e) * 1e3)
    us = float(np.median(ts))
    moved = rows * row_bytes * (2 if "copy" in name else 3)  # bytes read + written
    return us, moved / us / 1e3

ref = None
for name in names:
    line = []
    for sms in (4, 8, 16):
        try:
            us, gbps = run(name, sms)
        except Exception as exc:  # noqa
            line.append(f"{sms}: ERR {str(exc)[:60]}")
            continue
        line.append(f"{sms:2d} SMs {us:7.1f} us {gbps:6.1f} GB/s ({gbps / sms:5.1f}/SM)")
    # check results
    if "copy" in name:
        ok = bool(cupy.array_equal(dst, a))
    else:
        af = (a.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)
        bf = (b.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)
        ref = (af + bf)
        got = (dst.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)
        ok = bool(cupy.allclose(got, ref, rtol=1e-2))
    dst.fill(0)
    print(f"{name:36s} ok={ok}  " + " | ".join(line), flush=True)


# ---- peer writes: every GPU copies its rows into the other GPU's memory at once (as dispatch does) ----
ndev = cupy.cuda.runtime.getDeviceCount()
if ndev >= 2:
    for d in range(2):
        with cupy.cuda.Device(d):
            cupy.cuda.runtime.deviceEnablePeerAccess(1 - d)
    bufs = []
    for d in range(2):
        with cupy.cuda.Device(d):
            src = cupy.random.randint(0, 1 << 16, size=rows * row_int4 * 8, dtype=cupy.uint16)
            dstp = cupy.zeros_like(src)
            mods = cupy.RawModule(code=code, options=("-std=c++17", f"-I{src_dir}"), name_expressions=names,
                                  backend="nvrtc")
            bufs.append((src, dstp, mods, cupy.cuda.Stream(non_blocking=True)))
    for name in [n for n in names if "copy" in n]:
        line = []
        for sms in (4, 8, 12, 16):
            ts = []
            for i in range(23):
                evs = []
                for d in range(2):
                    with cupy.cuda.Device(d):
                        src, _, mods, st = bufs[d]
                        dstp = bufs[1 - d][1]
                        k = mods.get_function(name)
                        smem = smem_of(name)
                        if smem > 48 * 1024:
                            k.max_dynamic_shared_size_bytes = smem
                        s0, e0 = cupy.cuda.Event(), cupy.cuda.Event()
                        s0.record(st)
                        k((sms,), (threads_of(name),), (dstp, src, np.int32(rows), np.int32(row_int4)), shared_mem=smem,
                          stream=st)
                        e0.record(st)
                        evs.append((s0, e0))
                us = 0
                for d in range(2):
                    with cupy.cuda.Device(d):
                        evs[d][1].synchronize()
                        us = max(us, cupy.cuda.get_elapsed_time(*evs[d]) * 1e3)
                if i >= 3:
                    ts.append(us)
            us = float(np.median(ts))
            gbps = rows * row_bytes / us / 1e3
            line.append(f"{sms:2d} SMs {us:7.1f} us {gbps:6.1f} GB/s ({gbps / sms:5.1f}/SM)")
        ok = all(bool(cupy.array_equal(bufs[1 - d][1], bufs[d][0])) for d in range(2)) if False else "-"
        print(f"P2P {name:32s} " + " | ".join(line), flush=True)
