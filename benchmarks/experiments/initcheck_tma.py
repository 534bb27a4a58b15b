"""Does compute-sanitizer initcheck see bytes written by TMA bulk stores (cp.async.bulk)? Two kernels copy the same
rows into fresh cupy.empty buffers: copy_tma_warp (bulk stores) and copy_reg<4> (plain stores); then CuPy reads both."""
import os
import numpy as np
import cupy
here = os.path.dirname(os.path.abspath(__file__))
code = open(os.path.join(here, "mb_copy.cu")).read()
names = ["ep::copy_reg<4>", "ep::copy_tma_warp"]
mod = cupy.RawModule(code=code, options=("-std=c++17", f"-I{os.path.join(here, '..', '..', 'cuda_src')}"),
                     name_expressions=names, backend="nvrtc")
rows, row_int4 = 64, 7168 * 2 // 16
src = cupy.random.randint(0, 1 << 16, size=rows * row_int4 * 8, dtype=cupy.uint16)
for name in names:
    dst = cupy.empty_like(src)
    k = mod.get_function(name)
    smem = 24 * 8192 if "tma" in name else 0
    if smem:
        k.max_dynamic_shared_size_bytes = smem
    k((2,), (768,), (dst, src, np.int32(rows), np.int32(row_int4)), shared_mem=smem)
    cupy.cuda.runtime.deviceSynchronize()
    print(f"=== {name}: equal={bool(cupy.array_equal(dst, src))} (now reading dst with a CuPy kernel)", flush=True)
    s = int(dst.astype(cupy.uint64).sum())
    cupy.cuda.runtime.deviceSynchronize()
    print(f"=== {name}: read done", flush=True)
