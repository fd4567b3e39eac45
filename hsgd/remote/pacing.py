"""How much a windowed read asks one owner for at a time: sized by time on the link, not bytes.

Over TCP a one-sided read is a request and the owner's answer, on the one connection
each way between two processes. Whatever the owner has queued on that connection
(answers to this rank's reads and to other ranks' reads) comes before any later
message it sends: a doorbell, a flush's acknowledgement, a control word's answer, its
own read requests. So a read keeps two pieces in flight per owner, and the pieces
are short *in time*: a fixed 1 MiB piece is short at 1 Gbit/s but ten times longer
at 100 Mbit/s, and fixed small pieces would leave a 100 Gbit/s link idle between
pieces (each is a few Python and MPI calls). A :class:`Pacer` per owner measures the
rate at which a read's pieces arrive (bytes since the read began over the time since
it began: single pieces are no measure, two often arrive together) and sizes the next
piece to take ``TARGET_S`` at that rate, between ``least`` and ``most`` bytes. The
rate carries over to the next read. Figures: docs/benchmarks-appendix.md.
"""

from __future__ import annotations

import math
from typing import Optional

__all__ = ["Pacer", "TARGET_S", "LEAST_BYTES", "FIRST_BYTES"]

TARGET_S = 0.5e-3        # a piece's time on the link
LEAST_BYTES = 64 << 10   # the smallest piece (a slow link, or a congested one)
FIRST_BYTES = 64 << 10   # before anything was measured


class Pacer:
    """Piece sizes for reads from one owner. Not thread-safe; one per (region, owner).

    Example::

        >>> p = Pacer(most=4 << 20)
        >>> p.next_bytes()                    # nothing measured yet
        65536
        >>> p.begin(now=0.0)                  # a read from this owner begins
        >>> p.arrived(12_500_000, now=0.01)   # 1.25 GB/s: a 10 Gbit/s link
        >>> p.next_bytes()                    # 0.5 ms at 1.25 GB/s
        625000
    """

    def __init__(self, most: int, target: float = TARGET_S, least: int = LEAST_BYTES,
                 first: int = FIRST_BYTES):
        if not (0 < least <= most) or target <= 0:
            raise ValueError(f"Pacer needs 0 < least <= most and target > 0, got least={least}, "
                             f"most={most}, target={target}")
        self.most, self.target, self.least = int(most), float(target), int(least)
        self.first = min(int(first), self.most)
        self.rate: Optional[float] = None  # bytes per second, as measured over the last read
        self._began, self._bytes = math.inf, 0

    def next_bytes(self) -> int:
        """The size of the next piece to ask for."""
        if self.rate is None:
            return max(self.least, self.first)
        return int(min(self.most, max(self.least, self.rate * self.target)))

    def begin(self, now: float) -> None:
        """A read from this owner begins at ``now`` (``time.monotonic``)."""
        self._began, self._bytes = now, 0

    def arrived(self, nbytes: int, now: float) -> None:
        """A piece of ``nbytes`` of the read begun last arrived at ``now``."""
        self._bytes += nbytes
        if now > self._began:
            self.rate = self._bytes / (now - self._began)
