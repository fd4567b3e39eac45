"""LARS under HierarchicalSGD equals single-process LARS on the whole batch.

LARS's layer-wise rate depends on the gradient norm, so it is only right if
it sees the gradient averaged over every rank: each rank takes its shard of a
fixed batch, and after ``STEPS`` synchronized steps (with a warm-up/poly
schedule on the inner optimizer) its parameters must match one process
training on the whole batch to 1e-10 (float64). Works for any world size
that divides ``GLOBAL_BATCH``. ``inter_node='sharded'`` runs on equal virtual
nodes, several of them from 2 ranks on (see ``_models.LAYOUTS``), never falling back.
"""

import pytest
import torch
from _models import LAYOUTS, fixed_batch, mlp, shard

from hsgd import HierarchicalSGD, Topology
from hsgd.lars import LARS
from hsgd.schedules import WarmupPolyLR

STEPS = 8
DTYPE = torch.float64
VARIANTS = {
    "default": dict(lr=1.0, momentum=0.9, weight_decay=5e-4, trust_coefficient=0.02),
    "nesterov_clip": dict(lr=0.5, momentum=0.9, weight_decay=1e-3, trust_coefficient=0.2,
                          nesterov=True, clip=True),
    "all_tensors": dict(lr=1.0, momentum=0.8, weight_decay=1e-4, trust_coefficient=0.05,
                        exclude_1d=False),
}


def make_lars(params, variant):
    opt = LARS(params, **VARIANTS[variant])
    return opt, WarmupPolyLR(opt, total_steps=STEPS, warmup_steps=2, warmup_start_factor=0.5)


def loss_on(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def reference(variant):
    """One process, the whole batch."""
    model = mlp(DTYPE)
    opt, sched = make_lars(model.parameters(), variant)
    x, y = fixed_batch(DTYPE)
    for _ in range(STEPS):
        opt.zero_grad()
        loss_on(model, x, y).backward()
        opt.step()
        sched.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("inter_node", ["leader", "sharded"])
def test_lars_equals_single_process(comm, inter_node, variant):
    x, y = fixed_batch(DTYPE)
    xs, ys = shard(x, comm.rank, comm.size), shard(y, comm.rank, comm.size)
    model = mlp(DTYPE, seed=comm.rank)  # different init: the broadcast must fix it
    start = [p.detach().clone() for p in mlp(DTYPE).parameters()]
    topo = Topology.from_comm(comm, ranks_per_node=LAYOUTS[inter_node](comm))
    inner, sched = make_lars(model.parameters(), variant)
    opt = HierarchicalSGD(inner, model, topology=topo, inter_node=inter_node)
    assert opt.averager.inter_node == inter_node  # no fallback
    assert topo.num_nodes > 1 or comm.size == 1 or inter_node == "leader"
    for _ in range(STEPS):
        opt.zero_grad()
        loss_on(model, xs, ys).backward()
        opt.step()
        sched.step()
    opt.close()
    topo.close()
    want = reference(variant)
    params = list(model.parameters())
    assert len(params) == len(want) == len(start)
    for got, exp, init in zip(params, want, start):
        torch.testing.assert_close(got.detach(), exp, rtol=1e-10,
                                   atol=1e-10 * exp.abs().max().item())
        # the comparison means something only if LARS moved every tensor
        assert (exp - init).norm() > 1e-3 * init.norm()
