"""The low-latency dispatch handle: DeepEP's 5-tuple, carrying the dispatch's top-k slots as well."""
from __future__ import annotations


class LowLatencyHandle(tuple):
    """What ``low_latency_dispatch`` returns as ``handle``: DeepEP's ``(src_info [L, R*M] int32, layout_range
    [L, R] int64, M, H, E)``, indexed and unpacked as that 5-tuple, with one attribute more:

    ``topk_slots``: ``[T, K] int32``, the slot the dispatch gave each of this rank's top-k entries (its place
    among the rows its expert received from this rank; -1: no expert, or past the M slots). The combine finds the
    expert rows of each token by these slots instead of counting them again from ``topk_idx``, so pass the handle
    back as it is (a plain tuple made from its items has no slots: low_latency_combine raises ValueError) and give
    the combine the dispatch's ``topk_idx``.
    """

    def __new__(cls, fields, topk_slots):
        self = super().__new__(cls, fields)
        self.topk_slots = topk_slots
        return self

    def __repr__(self) -> str:
        return f"LowLatencyHandle({tuple.__repr__(self)}, topk_slots={self.topk_slots!r})"
