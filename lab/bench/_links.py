"""Inside a benchmark's workers on emulated hosts: the link counters, the wire limit, and gloo.

A worker started across hosts (``--hosts``, :class:`lab.bench._launch.Placement`)
runs in its host's network namespace, where ``eth0`` is the host's end of its
link: :class:`LinkMeter` reads what crossed it during a timed window (on one
rank per host, gathered to rank 0), so that a benchmark prints, next to each
time, the *wire limit*: the bytes that crossed the busiest link divided by its
rate (``--link``), plus the step without communication, and the fraction of
that limit the time reached. The bytes are measured, not modelled: they
include TCP/IP's headers and everything the method really sent.

:func:`init_gloo` starts ``torch.distributed``'s gloo across the hosts: its
store on rank 0's host address (``--master-addr``, set by the launcher), its
sockets on ``eth0`` (``GLOO_SOCKET_IFNAME``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional, Tuple

__all__ = ["on_hosts", "link_rates", "LinkMeter", "wire_limit", "init_gloo"]

_STATS = Path("/sys/class/net/eth0/statistics")


def on_hosts(args) -> bool:
    """Whether this job runs across emulated hosts (``--hosts``)."""
    return bool(getattr(args, "hosts", 0))


def link_rates(args) -> List[Optional[int]]:
    """Every host's link rate in bits/s (``None``: unshaped), from ``--link``."""
    from ..hosts import parse_rate

    rates = [parse_rate(r) for r in args.link.split(",")]
    return rates * args.hosts if len(rates) == 1 else rates


class LinkMeter:
    """What crossed each host's link during a window. Collective: every rank calls
    :meth:`start` and :meth:`stop`; rank 0 gets ``[(sent, received), ...]`` per host, in
    host order (hosts ordered by their lowest rank), the others ``None``."""

    def __init__(self, comm):
        from mpi4py import MPI

        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        self.reads = node.Get_rank() == 0  # one rank per host reads its eth0
        node.Free()
        self.comm = comm
        self._start: Optional[Tuple[int, int]] = None

    @staticmethod
    def _now() -> Tuple[int, int]:
        return int((_STATS / "tx_bytes").read_text()), int((_STATS / "rx_bytes").read_text())

    def start(self) -> None:
        self._start = self._now() if self.reads else None

    def stop(self):
        mine = None
        if self.reads:
            now, began = self._now(), self._start
            assert began is not None  # start() ran on a reading rank
            mine = (now[0] - began[0], now[1] - began[1])
        every = self.comm.gather(mine, root=0)
        return None if every is None else [m for m in every if m is not None]


def wire_limit(crossed, rates, floor: float, steps: int) -> Optional[float]:
    """Seconds per step at the wire limit: ``floor`` (the step without communication) plus the
    busiest link's bytes per step (the larger of sent and received: links are full duplex) over
    its rate; ``None`` if a link is unshaped or nothing was measured."""
    if not crossed or any(rate is None for rate in rates):
        return None
    busiest = max(max(sent, received) * 8 / rate for (sent, received), rate in zip(crossed, rates))
    return floor + busiest / steps


def init_gloo(args, comm, port: int) -> None:
    """``torch.distributed.init_process_group("gloo")`` over ``comm``'s ranks: on 127.0.0.1, or
    across emulated hosts on rank 0's host address and ``eth0``."""
    import torch.distributed as dist

    address = "127.0.0.1"
    if on_hosts(args):
        address = args._master
        os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=comm.rank,
                            world_size=comm.size)
