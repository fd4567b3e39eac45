"""The buckets of ``HierarchicalSGD(overlap=True)``: the bound gradients cut in the order
backward produces them (``hsgd.hierarchical.overlap``).

The first bucket is small (1 MB) so that averaging starts early, the others
up to ``bucket_cap_mb``, as DDP's; each bucket is one contiguous span of a
segment of the rank's slot.
"""

from __future__ import annotations

from typing import List, NamedTuple, Sequence, Tuple

import torch

__all__ = ["Bucket", "plan_buckets", "FIRST_BUCKET_MB"]

FIRST_BUCKET_MB = 1.0  # DDP's first bucket: small, so that averaging starts early


class Bucket(NamedTuple):
    """Elements ``[lo, hi)`` of slot segment ``segment``, holding the bound tensors ``params``
    (indices into the binding's parameters; empty for the used-flags)."""
    segment: int
    lo: int
    hi: int
    params: Tuple[int, ...]


def plan_buckets(layout, numels: Sequence[int], cap_bytes: float,
                 first_cap_bytes: float = FIRST_BUCKET_MB * 2 ** 20, tail: int = 0) -> List[Bucket]:
    """Buckets over the entries of ``layout``, whose sizes are ``numels``: all but the last
    ``tail`` in reverse order, a bucket ending when it reaches its cap (the first
    ``min(first_cap_bytes, cap_bytes)``, the others ``cap_bytes``) or the segment changes;
    then each of the last ``tail`` entries (the used-flags) as a bucket of its own."""
    def extent(i: int) -> Tuple[int, int]:
        return layout.extent(i, numels[i])

    buckets: List[Bucket] = []
    current: List[int] = []  # indices, highest first
    nbytes = 0
    for i in reversed(range(len(numels) - tail)):
        if current and layout.places[current[0]][0] != layout.places[i][0]:
            buckets.append(Bucket(layout.places[current[0]][0], extent(current[-1])[0], extent(current[0])[1],
                                  tuple(current)))
            current, nbytes = [], 0
        current.append(i)
        nbytes += numels[i] * torch.empty((), dtype=layout.dtypes[layout.places[i][0]]).element_size()
        if nbytes >= (min(first_cap_bytes, cap_bytes) if not buckets else cap_bytes) or i == 0:
            buckets.append(Bucket(layout.places[i][0], extent(i)[0], extent(current[0])[1], tuple(current)))
            current, nbytes = [], 0
    for i in range(len(numels) - tail, len(numels)):
        buckets.append(Bucket(layout.places[i][0], *extent(i), ()))
    return buckets
