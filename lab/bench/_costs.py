"""An alpha-beta cost model of one step's communication, for clusters we cannot run here.

Used by ``python -m lab.bench model``. Every strategy function returns the seconds one
step spends communicating, for a model of ``nbytes`` bytes on ``N`` nodes of ``k`` ranks
each, on a :class:`Machine`: the network's latency and bandwidth per node, MPI's inside
a node, hsgd's level 1 in the shared window, optional caps on one rank's stream and
the node's memory, and ``eta``, the fraction of the link delivered when streams from
several nodes meet at it. The formulas and what the model ignores are in
docs/benchmark-methods.md ("The cost model's formulas").

Example::

    >>> m = Machine(latency=2e-6, bandwidth=12.5e9, intra_latency=1e-6, intra_bandwidth=5e9)
    >>> round(leader(4e6, nodes=2, ranks_per_node=1, machine=m) * 1e6, 1)   # 2 alpha + 4e6 / B, in us
    324.0
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Dict, Optional

from hsgd._core.traffic import allreduce_bytes, sum_splits

__all__ = ["Machine", "STRATEGIES", "ring", "allreduce", "level1", "flat_ring", "leader", "sharded", "gossip", "box",
           "predict", "bytes_per_rank", "BOX_CHUNK_BYTES"]

#: RemoteMemory's transfer chunk (``hsgd.remote.memory.DEFAULT_CHUNK_BYTES``, which imports MPI:
#: a unit test checks the two agree).
BOX_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class Machine:
    """What the model knows of a cluster (seconds, bytes per second)."""

    latency: float                            #: alpha: one MPI message across nodes
    bandwidth: float                          #: B: one node's NIC, each direction
    intra_latency: float                      #: alpha_s: one round of a level-1 fence's barrier
    intra_bandwidth: float                    #: B_s: one rank's slot-to-slot copies in the window
    local_latency: Optional[float] = None     #: alpha_m: one MPI message inside a node (None: alpha)
    local_bandwidth: Optional[float] = None   #: B_m: MPI between two ranks of a node (None: B)
    stream_bandwidth: Optional[float] = None  #: S: what one rank can drive (None: B)
    memory_bandwidth: Optional[float] = None  #: M: a node's memory, shared in level 1 (None: no cap)
    gossip_rate: float = 1.0                  #: fraction of gossip rounds in which a rank sends
    fan_efficiency: float = 1.0               #: eta: B's fraction where several nodes' streams meet

    def stream(self, streams: int = 1) -> float:
        """Bytes per second of each of ``streams`` ranks sending through one NIC at once."""
        per = self.bandwidth / max(1, streams)
        return per if self.stream_bandwidth is None else min(per, self.stream_bandwidth)

    @property
    def local_alpha(self) -> float:
        return self.latency if self.local_latency is None else self.local_latency

    @property
    def local_rate(self) -> float:
        return self.bandwidth if self.local_bandwidth is None else self.local_bandwidth

    def local(self, nbytes: float) -> float:
        """Seconds of one MPI message of ``nbytes`` between two ranks of one node."""
        return self.local_alpha + nbytes / self.local_rate

    def remote(self, nbytes: float, streams: int = 1) -> float:
        """Seconds of one MPI message of ``nbytes`` across nodes, ``streams`` sharing the NIC."""
        return self.latency + nbytes / self.stream(streams)

    def as_dict(self) -> dict:
        return asdict(self)


def ring(nbytes: float, parties: int, rate: float, latency: float) -> float:
    """Seconds of a ring allreduce of ``nbytes`` among ``parties`` at ``rate`` bytes/s per party."""
    if parties <= 1:
        return 0.0
    return 2 * (parties - 1) * latency + 2 * (parties - 1) / parties * nbytes / rate


def allreduce(nbytes: float, parties: int, rate: float, latency: float, fan: float = 1.0) -> float:
    """Seconds of hsgd's level-2 sum (:mod:`hsgd._transport.sums`) of ``nbytes`` among ``parties``:
    :func:`ring`'s, but for more than two parties, not a power of two, the reduce-scatter is an
    all-to-all whose bytes move at ``fan`` of ``rate``."""
    if not sum_splits(parties):
        return ring(nbytes, parties, rate, latency)
    half = (parties - 1) / parties * nbytes / rate
    return 2 * (parties - 1) * latency + half / fan + half


def level1(nbytes: float, nodes: int, ranks_per_node: int, machine: Machine) -> float:
    """hsgd's level 1: the fences and the slot-to-slot copies of one average."""
    k = ranks_per_node
    fences = 2 if nodes == 1 else 4
    fence = machine.intra_latency * math.ceil(math.log2(k)) if k > 1 else 0.0
    rate = machine.intra_bandwidth
    if machine.memory_bandwidth is not None:
        rate = min(rate, machine.memory_bandwidth / k)
    return fences * fence + 2 * (k - 1) / k * nbytes / rate


def flat_ring(nbytes: float, nodes: int, ranks_per_node: int, machine: Machine) -> float:
    """One ring allreduce over all ``N k`` ranks, placed in blocks of ``k`` per node."""
    p = nodes * ranks_per_node
    if p <= 1:
        return 0.0
    chunk = nbytes / p
    hop = machine.local(chunk) if nodes == 1 else max(
        machine.remote(chunk), machine.local(chunk) if ranks_per_node > 1 else 0.0)
    return 2 * (p - 1) * hop


def leader(nbytes: float, nodes: int, ranks_per_node: int, machine: Machine) -> float:
    """hsgd's ``inter_node="leader"``: level 1, then the leaders allreduce the whole buffer."""
    return (level1(nbytes, nodes, ranks_per_node, machine)
            + allreduce(nbytes, nodes, machine.stream(1), machine.latency, machine.fan_efficiency))


def sharded(nbytes: float, nodes: int, ranks_per_node: int, machine: Machine) -> float:
    """hsgd's ``inter_node="sharded"``: level 1, then ``k`` concurrent rings of ``nbytes / k``."""
    k = ranks_per_node
    return (level1(nbytes, nodes, k, machine)
            + allreduce(nbytes / k, nodes, machine.stream(k), machine.latency, machine.fan_efficiency))


def gossip(nbytes: float, nodes: int, ranks_per_node: int, machine: Machine) -> float:
    """GossipSGD on the exponential graph: one round per step, averaged over the graph's rounds."""
    p, k = nodes * ranks_per_node, ranks_per_node
    if p <= 1:
        return 0.0
    rounds, sent = math.ceil(math.log2(p)), machine.gossip_rate * nbytes
    total = 0.0
    for j in range(rounds):  # offset 2^j: 2^j of a node's k ranks leave it (all if 2^j >= k)
        off_node = min(2 ** j, k) if nodes > 1 else 0
        total += max(machine.remote(sent, off_node) if off_node else 0.0,
                     machine.local(sent) if off_node < k else 0.0)
    return total / rounds


def box(nbytes: float, nodes: int, ranks_per_node: int, machine: Machine) -> float:
    """AsyncSGD's step against the parameter box: accumulate, then read, the whole model."""
    k = ranks_per_node
    if nodes * k <= 1:
        return 0.0
    chunks = nodes * math.ceil(nbytes / nodes / BOX_CHUNK_BYTES)
    if nodes == 1:  # one owner, reached through MPI's shared-memory transport
        return 2 * (chunks * machine.local_alpha + k * nbytes / machine.local_rate)
    fan = machine.fan_efficiency if nodes > 2 else 1.0
    return 2 * (chunks * machine.latency + k * (nodes - 1) / nodes * nbytes / (fan * machine.stream(1)))


#: name -> cost function ``(nbytes, nodes, ranks_per_node, machine) -> seconds``, in table order.
STRATEGIES: Dict[str, Callable[..., float]] = {
    "flat ring": flat_ring, "leader": leader, "sharded": sharded, "gossip": gossip, "box": box}


def predict(nbytes: float, nodes: int, ranks_per_node: int, machine: Machine) -> Dict[str, float]:
    """Seconds per step of every strategy in :data:`STRATEGIES`."""
    return {name: fn(nbytes, nodes, ranks_per_node, machine) for name, fn in STRATEGIES.items()}


def bytes_per_rank(strategy: str, nbytes: int, nodes: int, ranks_per_node: int) -> Dict[str, int]:
    """Rank 0's ``intra_bytes`` and ``inter_bytes`` for one average, as hsgd's
    :class:`~hsgd._core.traffic.Traffic` counts them (``leader`` and ``sharded``;
    ``nbytes`` divisible by ``16 k`` elements, so the slices are equal)."""
    k = ranks_per_node
    intra = 2 * (k - 1) * nbytes // k
    if nodes == 1:
        return {"intra_bytes": intra, "inter_bytes": 0}
    part = nbytes if strategy == "leader" else nbytes // k
    return {"intra_bytes": intra, "inter_bytes": allreduce_bytes(part, nodes)}
