"""The cost model of ``python -m lab.bench model``: its formulas in closed form, its bytes as hsgd counts them."""

import math

import pytest

from hsgd._core.traffic import allreduce_bytes
from hsgd.remote.memory import DEFAULT_CHUNK_BYTES
from lab.bench import _costs

M = _costs.Machine(latency=2e-6, bandwidth=10e9, intra_latency=1e-6, intra_bandwidth=4e9,
                   local_latency=0.5e-6, local_bandwidth=5e9)
N_BYTES = 8e6


def test_one_rank_communicates_nothing():
    assert _costs.predict(N_BYTES, 1, 1, M) == dict.fromkeys(_costs.STRATEGIES, 0.0)


def test_one_node_is_level_1_alone_and_the_flat_ring_runs_on_mpi_inside_the_node():
    k = 4
    level1 = 2 * M.intra_latency * 2 + 2 * (k - 1) / k * N_BYTES / M.intra_bandwidth
    assert _costs.leader(N_BYTES, 1, k, M) == pytest.approx(level1)
    assert _costs.sharded(N_BYTES, 1, k, M) == pytest.approx(level1)
    assert _costs.flat_ring(N_BYTES, 1, k, M) == pytest.approx(2 * (k - 1) * (0.5e-6 + N_BYTES / k / 5e9))


def test_across_nodes_leader_is_four_fences_plus_a_ring_of_the_leaders():
    nodes, k = 8, 2
    level1 = 4 * M.intra_latency + N_BYTES / M.intra_bandwidth  # 2 (k-1)/k = 1 for k = 2
    ring = 2 * 7 * M.latency + 2 * 7 / 8 * N_BYTES / M.bandwidth
    assert _costs.leader(N_BYTES, nodes, k, M) == pytest.approx(level1 + ring)
    assert _costs.sharded(N_BYTES, nodes, k, M) == pytest.approx(level1 + ring)  # k rings share the NIC


def test_sharded_wins_only_where_one_rank_cannot_fill_the_nic():
    slow = _costs.Machine(**{**M.as_dict(), "stream_bandwidth": 2.5e9})
    assert _costs.sharded(N_BYTES, 8, 4, slow) < _costs.leader(N_BYTES, 8, 4, slow)


def test_the_flat_ring_pays_a_latency_per_rank_the_leaders_one_per_node():
    tiny = 4.0
    assert _costs.flat_ring(tiny, 4096, 128, M) > 100 * _costs.leader(tiny, 4096, 128, M)


def test_gossip_and_box_in_closed_form():
    # 2 nodes x 2 ranks: rounds with offsets 1 (one rank per node leaves it) and 2 (both do)
    one = max(M.latency + N_BYTES / M.bandwidth, M.local_latency + N_BYTES / M.local_bandwidth)
    two = M.latency + N_BYTES / (M.bandwidth / 2)
    assert _costs.gossip(N_BYTES, 2, 2, M) == pytest.approx((one + two) / 2)
    half = _costs.Machine(**{**M.as_dict(), "gossip_rate": 0.5})
    assert _costs.gossip(N_BYTES, 2, 2, half) < _costs.gossip(N_BYTES, 2, 2, M)
    chunks = 2 * math.ceil(N_BYTES / 2 / DEFAULT_CHUNK_BYTES)
    assert _costs.box(N_BYTES, 2, 2, M) == pytest.approx(2 * (chunks * M.latency + N_BYTES / M.bandwidth))
    assert _costs.BOX_CHUNK_BYTES == DEFAULT_CHUNK_BYTES


@pytest.mark.parametrize("nodes, k", [(1, 4), (2, 1), (2, 2), (8, 4)])
def test_bytes_are_what_traffic_counts(nodes, k):
    nbytes = 4 * 64 * 1000
    leader, sharded = (_costs.bytes_per_rank(s, nbytes, nodes, k) for s in ("leader", "sharded"))
    assert leader["intra_bytes"] == sharded["intra_bytes"] == 2 * (k - 1) * nbytes // k
    assert leader["inter_bytes"] == (allreduce_bytes(nbytes, nodes) if nodes > 1 else 0)
    assert sharded["inter_bytes"] == (allreduce_bytes(nbytes // k, nodes) if nodes > 1 else 0)


def test_the_model_knows_hsgds_chunk():
    from hsgd.inter_node import CHUNK_BYTES
    from lab.bench import model

    assert model.CHUNK_BYTES == CHUNK_BYTES


def test_the_many_to_many_efficiency_slows_only_the_all_to_all_parts():
    """eta divides the rate of what several nodes send to each other at once: the box from 3 nodes
    on, and the reduce-scatter half of hsgd's sum for a node count > 2 that is not a power of two."""
    fan = _costs.Machine(**{**M.as_dict(), "fan_efficiency": 0.5})
    for nodes in (2, 4, 8):  # MPI_Allreduce (pairwise) and one peer node for the box: eta plays no part
        assert _costs.leader(N_BYTES, nodes, 2, fan) == pytest.approx(_costs.leader(N_BYTES, nodes, 2, M))
        assert _costs.sharded(N_BYTES, nodes, 2, fan) == pytest.approx(_costs.sharded(N_BYTES, nodes, 2, M))
    assert _costs.box(N_BYTES, 2, 2, fan) == pytest.approx(_costs.box(N_BYTES, 2, 2, M))
    half = 2 / 3 * N_BYTES / M.bandwidth  # 3 nodes: the reduce-scatter's bytes, at eta = 1
    assert _costs.allreduce(N_BYTES, 3, M.bandwidth, M.latency, 0.5) == pytest.approx(
        _costs.ring(N_BYTES, 3, M.bandwidth, M.latency) + half)
    assert _costs.leader(N_BYTES, 3, 2, fan) - _costs.leader(N_BYTES, 3, 2, M) == pytest.approx(half)
    link = 2 * 2 * 2 / 3 * N_BYTES / M.bandwidth  # the box's two phases at 3 nodes x 2, at eta = 1
    assert _costs.box(N_BYTES, 3, 2, fan) - _costs.box(N_BYTES, 3, 2, M) == pytest.approx(link)
    for name in ("flat ring", "gossip"):  # one peer node per rank and round
        assert _costs.STRATEGIES[name](N_BYTES, 3, 2, fan) == _costs.STRATEGIES[name](N_BYTES, 3, 2, M)
