"""``--clip-grad-norm``: where a training step clips, on a one-process stand-in for a mode."""

import contextlib

import pytest
import torch

from hsgd._trainer.loop import _fit_batch
from hsgd._trainer.metrics import PhaseClock
from hsgd._trainer.precision import MixedPrecision
from hsgd._trainer.tasks import Classification


class StandIn:
    """A mode's surface for ``_fit_batch``: SGD (lr 1, no momentum) on the model, whose
    ``synchronize()`` multiplies the gradients by ``factor`` (what an average of other ranks'
    gradients could do to their norm) and records the order of the calls."""

    def __init__(self, model, factor: float = 1.0):
        self.inner = torch.optim.SGD(model.parameters(), lr=1.0)
        self.param_groups = self.inner.param_groups
        self.model, self.factor, self.calls, self.norm_at_step = model, factor, [], None

    def zero_grad(self):
        self.inner.zero_grad()

    def synchronize(self):
        self.calls.append("synchronize")
        for p in self.model.parameters():
            p.grad.mul_(self.factor)

    def gradients_finite(self):
        return all(torch.isfinite(p.grad).all() for p in self.model.parameters())

    @contextlib.contextmanager
    def skip_synchronize(self):
        yield

    def step(self):
        self.calls.append("step")
        self.norm_at_step = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.grad) for p in self.model.parameters()])).item()
        self.inner.step()


def _step(average_first: bool, clip: float, factor: float = 1.0):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    opt = StandIn(model, factor)
    before = [p.detach().clone() for p in model.parameters()]
    batch = (torch.randn(16, 8) * 10, torch.randint(0, 3, (16,)))
    _fit_batch(model, opt, batch, torch.device("cpu"), PhaseClock(0), MixedPrecision("none", torch.device("cpu")),
               Classification(3), average_first=average_first, clip=clip)
    moved = torch.linalg.vector_norm(torch.cat([(p.detach() - b).flatten()
                                                for p, b in zip(model.parameters(), before)])).item()
    return opt, moved


@pytest.mark.parametrize("average_first", [False, True])
def test_the_update_is_the_clipped_gradient(average_first):
    free, moved_free = _step(average_first, clip=0.0)
    assert free.norm_at_step > 0.5  # large inputs: a gradient well above the clip below
    clipped, moved = _step(average_first, clip=0.05)
    assert clipped.norm_at_step == pytest.approx(0.05, rel=1e-5)
    assert moved == pytest.approx(0.05, rel=1e-5) and moved < moved_free  # SGD at lr 1 moves by the gradient
    loose, _ = _step(average_first, clip=1e6)  # a norm below the clip is left as it is
    assert loose.norm_at_step == pytest.approx(free.norm_at_step, rel=1e-6)


def test_a_mode_that_averages_first_clips_the_average_not_this_ranks_gradient():
    opt, moved = _step(True, clip=0.05, factor=100.0)  # the average is 100x this rank's gradient
    assert opt.calls == ["synchronize", "step"]
    assert opt.norm_at_step == pytest.approx(0.05, rel=1e-5) and moved == pytest.approx(0.05, rel=1e-5)
