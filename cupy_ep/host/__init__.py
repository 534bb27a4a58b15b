"""The host backend: numpy + MPI, the same interface as the CUDA backend (:mod:`.backend`), and its message
exchange (:mod:`.host_exchange`)."""
