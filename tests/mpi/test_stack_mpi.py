"""How deep hsgd is between ``opt.step()`` and the wire: the files one step passes through.

The node and leader communicators of the topology are wrapped in a subclass of
``MPI.Intracomm`` (same handle) whose reductions and gathers record the Python stack; one
``opt.step()`` of :class:`~hsgd.HierarchicalSGD` across two virtual nodes then shows
which of hsgd's files lie between the step and each MPI call. torch's and mpi4py's
frames do not count.
"""

import math
import os
import traceback

import pytest
import torch
from mpi4py import MPI

import hsgd
from hsgd import HierarchicalSGD, Topology

MAX_FILES = 6
# The calls that move the sums between nodes (a barrier or a fence inside the node is no step's data).
RECORDED = ("Allreduce", "Iallreduce", "Reduce_scatter", "Reduce_scatter_block", "Ireduce_scatter_block",
            "Allgather", "Allgatherv", "Iallgatherv", "Alltoallv", "Ialltoallv")


class _Recording(MPI.Intracomm):
    """An ``MPI.Intracomm`` over the same handle whose collectives append their stack to ``calls``."""

    calls: list = []


def _recorder(name):
    method = getattr(MPI.Intracomm, name)

    def recorded(self, *args, **kwargs):
        _Recording.calls.append((name, traceback.extract_stack()[:-1]))
        return method(self, *args, **kwargs)
    return recorded


for _name in RECORDED:
    setattr(_Recording, _name, _recorder(_name))


def _hsgd_files_below(stack, caller):
    """The hsgd files in ``stack`` below the frame of ``caller`` (this test's function)."""
    root = os.path.dirname(hsgd.__file__)
    start = max(i for i, frame in enumerate(stack) if frame.name == caller)
    return {os.path.relpath(frame.filename, root) for frame in stack[start + 1:] if frame.filename.startswith(root)}


def test_one_step_reaches_mpi_through_at_most_six_hsgd_files():
    """The default settings (the leader strategy, no compression): the leaders' allreduce."""
    comm = MPI.COMM_WORLD
    if comm.size < 2:
        pytest.skip("needs two (virtual) nodes")
    topo = Topology.from_comm(comm, ranks_per_node=math.ceil(comm.size / 2))
    topo.node_comm = _Recording(topo.node_comm)
    if topo.leader_comm is not None:
        topo.leader_comm = _Recording(topo.leader_comm)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, topology=topo)
    model(torch.randn(2, 8)).sum().backward()
    _Recording.calls.clear()
    opt.step()
    calls, leader = list(_Recording.calls), topo.is_leader
    opt.close()
    topo.close()
    files = set().union(*(_hsgd_files_below(stack, "test_one_step_reaches_mpi_through_at_most_six_hsgd_files")
                          for _, stack in calls))
    # The node leaders sum across nodes; the other ranks make no such call.
    assert bool(calls) == leader, [name for name, _ in calls]
    assert len(files) <= MAX_FILES, (sorted(files), [name for name, _ in calls])
