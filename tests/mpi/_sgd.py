"""Helpers of the synchronous-SGD tests: optimizers, the single-process reference and its
comparison, the ranks' training loop, the binding check and a model with a branch."""

import torch
from _models import fixed_batch, mlp, on, shard

STEPS = 10  # reference()'s default
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "momentum_wd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
}


def train_shards(model, opt, comm, dtype=torch.float64, steps=STEPS, *, zero_grad=None, step=None):
    """``steps`` steps on this rank's shard of :func:`fixed_batch` (the reference's whole batch,
    split over the ranks): ``zero_grad(i)`` (default ``opt.zero_grad()``), forward, backward,
    ``step(i)`` (default ``opt.step()``)."""
    x, y = fixed_batch(dtype, device=next(model.parameters()).device)
    xs, ys = shard(x, comm.rank, comm.size), shard(y, comm.rank, comm.size)
    for i in range(steps):
        zero_grad(i) if zero_grad else opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xs), ys).backward()
        step(i) if step else opt.step()


def check_binding(opt, binding):
    """``opt`` bound its tensors the ``binding`` way; staged ones are not views into the slot."""
    bound = opt.engine.binding
    assert bound.zero_copy == [binding == "zero_copy"] * len(bound.params)
    assert all(p.device.type == on(binding).type for p in bound.params)
    if binding != "zero_copy":
        current = [p.grad if bound.what == "grad" else p.data for p in bound.params]
        assert all(t is None or t.data_ptr() != v.data_ptr() for t, v in zip(current, bound.views))


def reference(dtype, make_opt, steps=STEPS, clip=None, device="cpu"):
    """Single-process training on the whole batch, on ``device``."""
    model = mlp(dtype, device=device)
    opt = make_opt(model.parameters())
    x, y = fixed_batch(dtype, device=device)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def assert_params_close(model, want, dtype):
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    got = list(model.parameters())
    assert len(got) == len(want)
    for g, exp in zip(got, want):
        torch.testing.assert_close(g.detach(), exp, rtol=tol, atol=tol * exp.abs().max().item())


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Linear(4, 4).double()
        self.branch = torch.nn.Linear(4, 1).double()

    def forward(self, x, use_branch):
        h = self.trunk(x)
        return h.sum() + (self.branch(h).sum() if use_branch else 0.0)
