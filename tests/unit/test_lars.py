"""LARS (hsgd.lars) against hand-computed values of Algorithm 1, no MPI.

Expected numbers are literals, derived with plain Python floats from the
formulas in the LARS docstring (lambda = eta ||w|| / (||g|| + beta ||w|| + eps),
u = lr lambda (g + beta w), v = m v + u, w -= v), never by calling hsgd.
"""

import copy

import pytest
import torch

from hsgd.lars import LARS, lars_local_lr
from hsgd.schedules import WarmupPolyLR

F64 = torch.float64


def t(values):
    return torch.tensor(values, dtype=F64)


def param(values):
    return torch.nn.Parameter(t(values))


def run(opt, params, grads_per_step):
    """Set each step's gradients, step, and return the params after each step."""
    history = []
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = t(g)
        opt.step()
        history.append([p.detach().clone() for p in params])
    return history


# Two 2-D tensors, three steps: A = [[3, 4]], B = [[1], [-2]].
GRADS = [([[0.6, -0.8]], [[0.1], [0.2]]),
         ([[0.3, 0.4]], [[-0.5], [0.25]]),
         ([[-1.0, 2.0]], [[0.0], [0.3]])]
HYPER = dict(lr=2.0, momentum=0.9, weight_decay=0.01, trust_coefficient=0.05, eps=1e-8)
EXPECTED = [([[2.7000000028571427, 4.36190475845805]], [[0.900000004065578], [-2.1636363569836]]),
            ([[2.125721007538643, 4.2748240587090525]], [[1.007542660094207], [-2.4027859793868007]]),
            ([[1.8134708321239237, 3.7694258871739246]], [[1.0962798530754907], [-2.8385478964072948]])]


def test_golden_local_lr():
    value = float(lars_local_lr(1.234, 5.678, trust_coefficient=0.001, weight_decay=1e-4, eps=1e-8))
    assert abs(value - 0.000217325) < 5e-10


def test_golden_local_lr_through_optimizer():
    w = param([[1.234, 0.0]])  # ||w|| = 1.234
    opt = LARS([w], lr=1.0, momentum=0.0, weight_decay=1e-4, trust_coefficient=0.001, eps=1e-8)
    (after,), = run(opt, [w], [([[0.0, 5.678]],)])  # ||g|| = 5.678
    local_lr = (t([[1.234, 0.0]]) - after) / t([[1.234e-4, 5.678]])  # update / (g + wd w)
    assert torch.allclose(local_lr, torch.full_like(local_lr, 0.000217325), rtol=0, atol=5e-10)


def test_three_steps_of_algorithm_1():
    a, b = param([[3.0, 4.0]]), param([[1.0], [-2.0]])
    history = run(LARS([a, b], **HYPER), [a, b], GRADS)
    for got, want in zip(history, EXPECTED):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, t(w), rtol=1e-14, atol=1e-14)


def test_zero_weight_or_zero_gradient_gives_local_lr_one():
    assert float(lars_local_lr(0.0, 3.0, 0.001)) == 1.0
    assert float(lars_local_lr(2.0, 0.0, 0.001)) == 1.0
    zero_w, zero_g = param([[0.0, 0.0]]), param([[3.0, 4.0]])
    opt = LARS([zero_w, zero_g], lr=0.5, momentum=0.0, weight_decay=0.1)
    (w1, w2), = run(opt, [zero_w, zero_g], [([[1.0, -2.0]], [[0.0, 0.0]])])
    torch.testing.assert_close(w1, t([[-0.5, 1.0]]))          # w - lr * g
    torch.testing.assert_close(w2, t([[2.85, 3.8]]))           # w - lr * wd * w


@pytest.mark.parametrize("nesterov", [False, True])
def test_excluded_1d_tensors_follow_momentum_sgd(nesterov):
    torch.manual_seed(0)
    start = torch.randn(5, dtype=F64)
    bias, ref = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    lars = LARS([bias], lr=0.3, momentum=0.9, weight_decay=0.1, nesterov=nesterov)
    sgd = torch.optim.SGD([ref], lr=0.3, momentum=0.9, nesterov=nesterov)
    for _ in range(4):
        grad = torch.randn(5, dtype=F64)
        bias.grad, ref.grad = grad.clone(), grad.clone()
        lars.step()
        sgd.step()
        torch.testing.assert_close(bias, ref, rtol=1e-13, atol=1e-13)
    assert not torch.allclose(bias, start)  # it moved, and weight decay was not applied


def test_exclude_1d_false_adapts_vectors():
    v = param([3.0, 4.0])
    opt = LARS([v], lr=1.0, momentum=0.0, trust_coefficient=0.1, eps=0.0, exclude_1d=False)
    (after,), = run(opt, [v], [([0.6, -0.8],)])  # lambda = 0.1 * 5 / 1 = 0.5
    torch.testing.assert_close(after, t([2.7, 4.4]))


def test_nesterov_two_steps():
    a = param([[3.0, 4.0]])
    history = run(LARS([a], nesterov=True, **HYPER), [a], [g[:1] for g in GRADS[:2]])
    torch.testing.assert_close(history[0][0], t([[2.430000005428571, 4.687619041070295]]),
                               rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(history[1][0], t([[1.5984703563940559, 4.169784749277415]]),
                               rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("lr, trust, want", [
    (0.1, 1.0, [[2.94, 4.08]]),     # lambda = 5 > lr: rate = lr = 0.1 (unclipped: 0.5)
    (2.0, 0.01, [[2.97, 4.04]]),    # lambda = 0.05 < lr: rate = 0.05 (unclipped: 0.1)
])
def test_clip_rate_is_min_of_local_lr_and_lr(lr, trust, want):
    a = param([[3.0, 4.0]])
    opt = LARS([a], lr=lr, momentum=0.0, trust_coefficient=trust, eps=0.0, clip=True)
    (after,), = run(opt, [a], [([[0.6, -0.8]],)])
    torch.testing.assert_close(after, t(want))


def test_clip_with_zero_weight_uses_global_lr():
    a = param([[0.0, 0.0]])
    (after,), = run(LARS([a], lr=2.0, momentum=0.0, clip=True), [a], [([[1.0, 1.0]],)])
    torch.testing.assert_close(after, t([[-2.0, -2.0]]))


def test_per_group_overrides():
    a, b, bias = param([[3.0, 4.0]]), param([[3.0, 4.0]]), param([1.0, 1.0])
    opt = LARS([{"params": [a]},
                {"params": [b], "trust_coefficient": 0.2, "weight_decay": 0.0},
                {"params": [bias], "exclude_1d": False, "lr": 0.5}],
               lr=1.0, momentum=0.0, weight_decay=0.5, trust_coefficient=0.1, eps=0.0)
    (wa, wb, wbias), = run(opt, [a, b, bias], [([[0.6, -0.8]], [[0.6, -0.8]], [0.0, 2.0])])
    # a: lambda = 0.1*5/(1+2.5) = 1/7, u = (g + 0.5 w)/7 = [2.1, 1.2]/7
    torch.testing.assert_close(wa, t([[2.7, 4.0 - 1.2 / 7]]))
    # b: lambda = 0.2*5/1 = 1, no decay: u = g
    torch.testing.assert_close(wb, t([[2.4, 4.8]]))
    # bias: lambda = 0.1*sqrt(2)/(2 + 0.5 sqrt(2)), u = 0.5 lambda (g + 0.5 w)
    lam = 0.1 * 2 ** 0.5 / (2 + 0.5 * 2 ** 0.5)
    torch.testing.assert_close(wbias, t([1 - 0.5 * lam * 0.5, 1 - 0.5 * lam * 2.5]))


@pytest.mark.parametrize("kwargs, name", [
    (dict(lr=-0.1), "learning rate"),
    (dict(lr=float("nan")), "learning rate"),
    (dict(momentum=-0.5), "momentum"),
    (dict(momentum=1.0), "momentum"),
    (dict(weight_decay=-1e-4), "weight_decay"),
    (dict(trust_coefficient=0.0), "trust_coefficient"),
    (dict(eps=-1.0), "eps"),
    (dict(momentum=0.0, nesterov=True), "nesterov"),
])
def test_bad_arguments_raise_value_error_naming_them(kwargs, name):
    args = {"lr": 0.1, **kwargs}
    with pytest.raises(ValueError, match=name):
        LARS([param([[1.0]])], **args)


def test_bad_group_override_raises_with_group_index():
    with pytest.raises(ValueError, match=r"momentum value in param group 1"):
        LARS([{"params": [param([[1.0]])]}, {"params": [param([[2.0]])], "momentum": 2.0}],
             lr=0.1)


def test_sparse_gradient_raises():
    a = param([[1.0, 2.0]])
    a.grad = t([[1.0, 0.0]]).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        LARS([a], lr=0.1).step()


def test_grad_is_not_modified():
    a, bias = param([[3.0, 4.0]]), param([1.0, 2.0])
    opt = LARS([a, bias], lr=1.0, weight_decay=0.1, nesterov=True)
    for _ in range(2):
        a.grad, bias.grad = t([[0.6, -0.8]]), t([0.5, 0.5])
        grads = [a.grad, bias.grad]
        opt.step()
        assert a.grad is grads[0] and bias.grad is grads[1]
        assert torch.equal(a.grad, t([[0.6, -0.8]])) and torch.equal(bias.grad, t([0.5, 0.5]))


def test_state_dict_round_trip_continues_identically():
    a, b = param([[3.0, 4.0]]), param([[1.0], [-2.0]])
    opt = LARS([a, b], **HYPER)
    run(opt, [a, b], GRADS[:1])
    a2, b2 = param(a.tolist()), param(b.tolist())
    opt2 = LARS([a2, b2], lr=0.5)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert opt2.param_groups[0]["trust_coefficient"] == HYPER["trust_coefficient"]
    for got, want in zip(run(opt2, [a2, b2], GRADS[1:]), run(opt, [a, b], GRADS[1:])):
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    torch.testing.assert_close(a2, t(EXPECTED[2][0]), rtol=1e-14, atol=1e-14)


def test_old_checkpoint_without_new_options_loads_with_defaults():
    a = param([[3.0, 4.0]])
    state = LARS([a], lr=0.1).state_dict()
    for key in ("trust_coefficient", "eps", "nesterov", "exclude_1d", "clip"):
        del state["param_groups"][0][key]
    opt = LARS([a], lr=0.1, clip=True, exclude_1d=False)
    opt.load_state_dict(state)
    group = opt.param_groups[0]
    assert (group["clip"], group["exclude_1d"], group["trust_coefficient"]) == (False, True, 0.001)


def test_closure_loss_is_returned_and_gradients_enabled():
    a = param([[3.0, 4.0]])
    opt = LARS([a], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (a ** 2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 25.0
    assert not torch.equal(a.detach(), t([[3.0, 4.0]]))


def test_rosenbrock_converges_with_poly_schedule():
    p = torch.nn.Parameter(t([[1.5, 1.5]]))
    opt = LARS([p], lr=1.0, momentum=0.9, trust_coefficient=0.01)
    sched = WarmupPolyLR(opt, total_steps=1000, warmup_steps=50)

    def rosenbrock():
        x, y = p[0, 0], p[0, 1]
        return (1 - x) ** 2 + 100 * (y - x ** 2) ** 2

    for _ in range(1000):
        opt.zero_grad()
        rosenbrock().backward()
        opt.step()
        sched.step()
    assert torch.dist(p.detach(), t([[1.0, 1.0]])) < 1e-3
