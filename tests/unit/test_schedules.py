"""hsgd.schedules: closed forms at step 0, end of warm-up and last step; no MPI.

Expected rates are computed by hand from the module docstring's formulas.
"""

import pytest
import torch

from hsgd.lars import LARS
from hsgd.schedules import WarmupMultiStepLR, WarmupPolyLR, scaled_lr


def make_opt(*lrs, kind="sgd"):
    groups = [{"params": [torch.nn.Parameter(torch.ones(2, 2))], "lr": lr} for lr in lrs]
    if kind == "lars":
        return LARS(groups, lr=lrs[0])
    return torch.optim.SGD(groups, lr=lrs[0], momentum=0.9)


def lrs_over(sched, steps):
    """Rate of every group at t = 0 .. steps (optimizer.step() before each step())."""
    seen = [sched.get_last_lr()]
    for _ in range(steps):
        sched.optimizer.step()
        sched.step()
        seen.append(sched.get_last_lr())
    return seen


POLY = dict(total_steps=10, warmup_steps=4, power=2.0, end_lr=0.01, warmup_start_factor=0.25)
POLY_EXPECTED = {0: 0.2, 2: 0.5, 4: 0.8, 7: 0.01 + 0.79 * 0.25, 9: 0.01 + 0.79 / 36, 10: 0.01,
                 12: 0.01}


@pytest.mark.parametrize("kind", ["sgd", "lars"])
def test_poly_closed_form(kind):
    opt = make_opt(0.8, kind=kind)
    seen = lrs_over(WarmupPolyLR(opt, **POLY), 12)
    for step, want in POLY_EXPECTED.items():
        assert seen[step][0] == pytest.approx(want, rel=1e-12), step
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01, rel=1e-12)


def test_poly_without_warmup_is_the_lars_paper_rule():
    seen = lrs_over(WarmupPolyLR(make_opt(0.8, 0.08), total_steps=10), 10)
    for step in range(11):
        factor = (1 - step / 10) ** 2
        assert seen[step] == pytest.approx([0.8 * factor, 0.08 * factor], rel=1e-12, abs=1e-15)


def test_poly_default_warmup_starts_from_zero_and_reaches_base_lr():
    seen = lrs_over(WarmupPolyLR(make_opt(0.4), total_steps=8, warmup_steps=4, power=1.0), 8)
    assert [s[0] for s in seen] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4, 0.3, 0.2, 0.1, 0.0])


MULTI = dict(milestones=[5, 8], gamma=0.1, warmup_steps=3, warmup_start_factor=0.1)
MULTI_EXPECTED = {0: 0.04, 1: 0.16, 3: 0.4, 4: 0.4, 5: 0.04, 7: 0.04, 8: 0.004, 20: 0.004}


@pytest.mark.parametrize("kind", ["sgd", "lars"])
def test_multistep_closed_form(kind):
    seen = lrs_over(WarmupMultiStepLR(make_opt(0.4, 4.0, kind=kind), **MULTI), 20)
    for step, want in MULTI_EXPECTED.items():
        assert seen[step] == pytest.approx([want, 10 * want], rel=1e-12), step


def test_multistep_without_warmup_starts_at_base_lr():
    seen = lrs_over(WarmupMultiStepLR(make_opt(1.0), milestones=[2], gamma=0.5), 3)
    assert [s[0] for s in seen] == pytest.approx([1.0, 1.0, 0.5, 0.5])


@pytest.mark.parametrize("make", [lambda opt: WarmupPolyLR(opt, **POLY),
                                  lambda opt: WarmupMultiStepLR(opt, **MULTI)])
def test_state_dict_round_trip(make):
    opt = make_opt(0.8, 0.08)
    sched = make(opt)
    lrs_over(sched, 5)
    opt2 = make_opt(0.8, 0.08)
    sched2 = make(opt2)
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    assert sched2.last_epoch == 5 and sched2.get_last_lr() == sched.get_last_lr()
    assert lrs_over(sched2, 8) == lrs_over(sched, 8)


def test_resume_with_last_epoch():
    opt = make_opt(0.8)
    WarmupPolyLR(opt, **POLY)
    resumed = WarmupPolyLR(opt, **POLY, last_epoch=6)  # base lr comes from initial_lr
    assert resumed.get_last_lr()[0] == pytest.approx(POLY_EXPECTED[7], rel=1e-12)


@pytest.mark.parametrize("kwargs, name", [
    (dict(total_steps=0), "total_steps"),
    (dict(total_steps=-5), "total_steps"),
    (dict(total_steps=2.5), "total_steps"),
    (dict(total_steps=True), "total_steps"),
    (dict(total_steps=10, warmup_steps=-1), "warmup_steps"),
    (dict(total_steps=10, warmup_steps=10), "warmup_steps"),
    (dict(total_steps=10, warmup_steps=12), "warmup_steps"),
    (dict(total_steps=10, power=0.0), "power"),
    (dict(total_steps=10, power=-2.0), "power"),
    (dict(total_steps=10, end_lr=-0.1), "end_lr"),
    (dict(total_steps=10, warmup_steps=2, warmup_start_factor=1.5), "warmup_start_factor"),
    (dict(total_steps=10, warmup_steps=2, warmup_start_factor=-0.1), "warmup_start_factor"),
])
def test_poly_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        WarmupPolyLR(make_opt(0.1), **kwargs)


@pytest.mark.parametrize("kwargs, name", [
    (dict(milestones=[5, 5]), "milestones"),
    (dict(milestones=[8, 5]), "milestones"),
    (dict(milestones=[2], warmup_steps=3), "warm-up"),
    (dict(milestones=[0]), "milestone"),
    (dict(milestones=[1.5]), "milestone"),
    (dict(milestones=[5], gamma=0.0), "gamma"),
    (dict(milestones=[5], gamma=-0.1), "gamma"),
    (dict(milestones=[5], warmup_steps=-2), "warmup_steps"),
    (dict(milestones=[5], warmup_steps=2, warmup_start_factor=2.0), "warmup_start_factor"),
])
def test_multistep_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        WarmupMultiStepLR(make_opt(0.1), **kwargs)


def test_pointless_settings_warn():
    with pytest.warns(UserWarning, match="gamma"):
        WarmupMultiStepLR(make_opt(0.1), milestones=[3], gamma=1.0)
    with pytest.warns(UserWarning, match="end_lr"):
        WarmupPolyLR(make_opt(0.1), total_steps=10, end_lr=0.5)


def test_scaled_lr():
    assert scaled_lr(0.1, 8192) == pytest.approx(3.2, rel=1e-15)
    assert scaled_lr(0.1, 256) == pytest.approx(0.1, rel=1e-15)
    assert scaled_lr(0.2, 512, base_batch=1024) == pytest.approx(0.1, rel=1e-15)


@pytest.mark.parametrize("args, name", [
    ((0.1, 0), "global_batch"), ((0.1, -256), "global_batch"), ((0.1, 256.0), "global_batch"),
    ((0.1, 256, 0), "base_batch"), ((-0.1, 256), "base_lr"),
])
def test_scaled_lr_bad_arguments(args, name):
    with pytest.raises(ValueError, match=name):
        scaled_lr(*args)
