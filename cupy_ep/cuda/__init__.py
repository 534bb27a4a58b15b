"""The CUDA backend: :mod:`.backend` builds the runtime and the paths the topology needs; :mod:`.intranode`,
:mod:`.internode` and :mod:`.low_latency` are the paths (one per kernel file of ``cuda_src/``)."""
