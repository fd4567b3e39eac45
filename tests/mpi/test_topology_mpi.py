"""Topology under mpiexec: node layouts, virtual nodes, bad settings."""

import os

import pytest
import torch
from _models import expected_nodes, hosts

from hsgd import Topology


@pytest.mark.parametrize("rpn", [1, 2, 3, None])
def test_layout(comm, rpn):
    """The nodes are the hosts (from the host names, not from MPI), cut into virtual nodes of
    ``rpn`` consecutive ranks: one host under a plain mpiexec, several in tests/hosts."""
    topo = Topology.from_comm(comm, ranks_per_node=rpn)  # closed at the end: see test_hsgd_mpi.py
    nodes = expected_nodes(comm, rpn)
    mine = next(i for i, ranks in enumerate(nodes) if comm.rank in ranks)
    assert list(topo.node_sizes) == [len(ranks) for ranks in nodes]
    assert topo.num_nodes == len(nodes)
    assert topo.node_index == mine
    assert list(topo.node_ranks) == nodes[mine]
    assert topo.local_rank == nodes[mine].index(comm.rank)
    assert topo.local_size == len(nodes[mine])
    assert topo.is_leader == (topo.local_rank == 0)
    assert (topo.leader_comm is not None) == topo.is_leader
    if topo.is_leader:
        assert topo.leader_comm.size == topo.num_nodes
    assert topo.node_comm.size == topo.local_size
    topo.close()


def test_env_variable(comm, monkeypatch):
    monkeypatch.setenv("HSGD_RANKS_PER_NODE", "2")
    topo = Topology.from_comm(comm)
    assert list(topo.node_sizes) == [len(ranks) for ranks in expected_nodes(comm, 2)]
    topo.close()
    topo = Topology.from_comm(comm, ranks_per_node=1)  # argument wins
    assert topo.num_nodes == comm.size
    topo.close()


@pytest.mark.parametrize("bad", ["0", "-2", "two", "1.5"])
def test_bad_env_raises_everywhere(comm, monkeypatch, bad):
    monkeypatch.setenv("HSGD_RANKS_PER_NODE", bad)
    with pytest.raises(ValueError, match="HSGD_RANKS_PER_NODE"):
        Topology.from_comm(comm)


def test_bad_value_on_one_rank_raises_everywhere(comm):
    rpn = 0 if comm.rank == comm.size - 1 else 2
    with pytest.raises(ValueError, match="ranks_per_node"):
        Topology.from_comm(comm, ranks_per_node=rpn)


def test_disagreeing_values_raise_everywhere(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    with pytest.raises(ValueError, match="disagree"):
        Topology.from_comm(comm, ranks_per_node=1 + (comm.rank == 0))


def test_trainer_threads_share_the_host_not_the_virtual_node(comm, shared_dir, monkeypatch):
    """With virtual nodes of one rank, a rank still shares its host's cores with the others
    (it took them all before: 2 ranks on 2 cores, 2 threads each, 40x slower)."""
    from hsgd._trainer.config import parse_config
    from hsgd._trainer.setup import setup

    for var in ("OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK"):
        monkeypatch.delenv(var, raising=False)
    threads = torch.get_num_threads()
    try:
        cfg = parse_config(["--ranks-per-node", "1", "--run-dir", str(shared_dir / "threads")], quiet=True)
        topo = setup(cfg, comm)[0]
        assert topo.local_size == 1
        on_host = next(len(ranks) for ranks in hosts(comm) if comm.rank in ranks)
        assert torch.get_num_threads() == max(1, len(os.sched_getaffinity(0)) // on_host)
        topo.close()
    finally:
        torch.set_num_threads(threads)
