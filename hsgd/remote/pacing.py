"""How much a windowed read asks one owner for at a time: sized by time on the link, not bytes.

Over TCP a one-sided read is a request to the owner and the owner's answer,
on the one connection each way between two processes. Whatever the owner has
queued on that connection (answers to this rank's reads, and equally its
answers to the *other* ranks reading from it at the same time) comes before
any later message it sends: a doorbell, a flush's acknowledgement, a control
word's answer, or its own read requests. So a read keeps only a small window
in flight per owner (two pieces), and the pieces should be short *in time*:
a fixed 1 MiB piece is 8 ms at 1 Gbit/s but 90 ms at 100 Mbit/s, and at that
rate the box step at 2 hosts x 1 rank, 1 MB, took 111 ms against a wire limit
of 84 (a rank's version bump waited 41 ms behind its answers to the other
rank's read). With pieces of 64 KiB it took 84 ms, and 64 KiB pieces were
as fast as any larger ones at 1 Gbit/s too (3 hosts x 1 rank, 16 MB: 189 ms
against 206 for 256 KiB, the wire 179). Fixed small pieces would cost the
fast networks instead: each piece is a few Python and MPI calls, so at
64 KiB a 100 Gbit/s link would be idle between pieces (arithmetic, not
measured here: 64 KiB is 5 us at 100 Gbit/s).

A :class:`Pacer` per owner measures the rate at which a read's pieces from
that owner arrive (the bytes arrived since the read began, over the time since
it began: single pieces are no measure, two of them often arrive together)
and sizes the next piece to take ``target`` seconds (0.5 ms) at that rate,
between ``least`` (64 KiB) and ``most`` bytes (the region's chunk): 64 KiB up
to 1 Gbit/s, larger pieces from about 1 Gbit/s up. The rate carries over to
the next read.
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
