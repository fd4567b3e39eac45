"""Gossip peer schedules: every rank computes the same round, so senders and receivers agree."""

import pytest

from hsgd.gossip.graphs import GRAPHS, make_graph

SIZES = range(1, 10)
ROUNDS = range(40)


@pytest.mark.parametrize("name", sorted(GRAPHS))
@pytest.mark.parametrize("size", SIZES)
def test_a_receiver_always_knows_its_senders(name, size):
    """j is an out-peer of i in round t exactly when i is an in-peer of j: no unmatched message."""
    graph = make_graph(name, size, seed=3)
    for t in ROUNDS:
        peers = [graph.peers(t, r) for r in range(size)]
        edges = {(i, j) for i, (outs, _) in enumerate(peers) for j in outs}
        assert edges == {(i, j) for j, (_, ins) in enumerate(peers) for i in ins}, t
        assert all(i != j and 0 <= j < size for i, j in edges), t
        if graph.symmetric:
            assert all((j, i) in edges for i, j in edges), t


@pytest.mark.parametrize("size", SIZES)
def test_random_matchings_never_pair_a_rank_with_itself_and_cover_every_rank(size):
    graph = make_graph("random", size, seed=7)
    matchings = set()
    for t in ROUNDS:
        partners = [graph.peers(t, r)[0] for r in range(size)]
        assert all(len(p) <= 1 for p in partners)
        paired = [r for r, p in enumerate(partners) if p]
        assert len(paired) == size - size % 2, t  # all, or all but the odd one out
        assert all(partners[partners[r][0]] == [r] and partners[r] != [r] for r in paired), t
        matchings.add(tuple(tuple(p) for p in partners))
    if size >= 4:
        assert len(matchings) > 1  # a fresh matching each round
    assert make_graph("random", size, seed=7).peers(5, 0) == graph.peers(5, 0)  # shared seed


@pytest.mark.parametrize("size", SIZES)
def test_ring_uses_every_ring_edge_and_rotates_who_sits_out(size):
    graph = make_graph("ring", size)
    used, out = set(), set()
    for t in range(2 * size):
        for r in range(size):
            partners = graph.peers(t, r)[0]
            if not partners:
                out.add(r)
            for p in partners:
                assert (p - r) % size in (1, size - 1)  # ring neighbours only
                used.add(frozenset((r, p)))
    if size >= 2:
        assert used == {frozenset((r, (r + 1) % size)) for r in range(size)}
    assert out == (set(range(size)) if size % 2 else set())


@pytest.mark.parametrize("size", SIZES)
def test_exponential_sends_to_powers_of_two_in_turn(size):
    graph = make_graph("exponential", size)
    if size == 1:
        assert graph.peers(0, 0) == ([], [])
        return
    distances = [1 << k for k in range(size) if 1 << k < size]
    for t in range(3 * len(distances)):
        d = distances[t % len(distances)]
        for r in range(size):
            assert graph.peers(t, r) == ([(r + d) % size], [(r - d) % size])
