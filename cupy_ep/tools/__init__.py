"""The tools around the library, none of which a user's program imports: the benchmark (``bench``, its modes
``bench_ll`` and ``bench_internode``), the soaks (``soak``, ``soak_ll``), the config tuner (``tune``), their
timing harness (``harness``), their command lines (``cli``) and the model shapes they run (``models``). Started
as ``python -m cupy_ep.bench``, ``python -m cupy_ep.soak`` and ``python -m cupy_ep.tune``."""
