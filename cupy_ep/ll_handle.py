"""The low-latency dispatch handle (kept importable from here; it lives in :mod:`cupy_ep.handles`)."""
from __future__ import annotations

from .handles import LowLatencyHandle

__all__ = ["LowLatencyHandle"]
