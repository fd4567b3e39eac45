"""LARS: layer-wise adaptive rate scaling for large-batch SGD.

Algorithm 1 of You, Gitman, Ginsburg, "Large Batch Training of Convolutional Networks",
2017 (https://arxiv.org/abs/1708.03888), with the optional clipping variant (LARC) of
NVIDIA apex's ``apex/parallel/LARC.py``. Every parameter tensor ("layer") gets its own
rate, proportional to the ratio of its weight norm to its gradient norm, so that no
layer's step is large compared with its weights however large the global batch is.

Example::

    >>> from hsgd.lars import LARS
    >>> from hsgd.schedules import scaled_lr
    >>> opt = LARS(model.parameters(), lr=scaled_lr(0.1, 8192), weight_decay=5e-4)
    >>> loss_fn(model(x), y).backward()
    >>> opt.step()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Union

import torch
from torch import Tensor
from torch.optim import Optimizer

from .errors import InputValueError

if TYPE_CHECKING:
    from torch.optim.optimizer import ParamsT

__all__ = ["LARS", "lars_local_lr"]

Number = Union[float, Tensor]

# Defaults of the options added after the first release of a checkpoint
# format: ``__setstate__`` fills them in, so old optimizer states still load.
_OPTION_DEFAULTS = {"trust_coefficient": 0.001, "eps": 1e-8, "nesterov": False,
                    "exclude_1d": True, "clip": False}


def lars_local_lr(w_norm: Number, g_norm: Number, trust_coefficient: float,
                  weight_decay: float = 0.0, eps: float = 1e-8) -> Tensor:
    r"""The local (layer-wise) learning rate :math:`\lambda` of LARS.

    .. math::
        \lambda = \eta \frac{\lVert w \rVert}
                           {\lVert g \rVert + \beta \lVert w \rVert + \epsilon},
        \qquad \lambda = 1 \text{ if } \lVert w \rVert = 0
        \text{ or } \lVert g \rVert = 0,

    with :math:`\eta` the trust coefficient and :math:`\beta` the weight
    decay. Norms may be Python numbers (computed in float64) or tensors (the
    result has their dtype and device; no host synchronization).
    """
    if not isinstance(w_norm, Tensor):
        w_norm = torch.tensor(float(w_norm), dtype=torch.float64)
    if not isinstance(g_norm, Tensor):
        g_norm = torch.tensor(float(g_norm), dtype=w_norm.dtype, device=w_norm.device)
    ratio = trust_coefficient * w_norm / (g_norm + weight_decay * w_norm + eps)
    adaptive = (w_norm > 0) & (g_norm > 0)
    return torch.where(adaptive, ratio, torch.ones_like(ratio))


def _check_options(lr, momentum, weight_decay, trust_coefficient, eps,
                   nesterov, where: str = "") -> None:
    """Raise ValueError naming the first bad hyper-parameter and the fix."""
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise InputValueError(f"Invalid learning rate{where}: a tensor lr must have "
                              f"one element, got shape {tuple(lr.shape)}")
    if not lr >= 0.0:
        raise InputValueError(f"Invalid learning rate{where}: {lr}; use lr >= 0")
    if not 0.0 <= momentum < 1.0:
        raise InputValueError(f"Invalid momentum value{where}: {momentum}; use "
                              "0 <= momentum < 1 (0.9 is the usual choice, 0 disables it)")
    if not weight_decay >= 0.0:
        raise InputValueError(f"Invalid weight_decay value{where}: {weight_decay}; "
                              "use weight_decay >= 0 (e.g. 5e-4 as in the LARS paper)")
    if not trust_coefficient > 0.0:
        raise InputValueError(f"Invalid trust_coefficient value{where}: {trust_coefficient}; "
                              "use trust_coefficient > 0 (0.001 in the LARS paper)")
    if not eps >= 0.0:
        raise InputValueError(f"Invalid eps value{where}: {eps}; use eps >= 0 (e.g. 1e-8)")
    if nesterov and momentum <= 0.0:
        raise InputValueError(f"Invalid nesterov=True{where} with momentum={momentum}: "
                              "Nesterov momentum needs momentum > 0; set momentum "
                              "(e.g. 0.9) or nesterov=False")


class LARS(Optimizer):
    r"""Momentum SGD with layer-wise adaptive rate scaling (LARS / LARC).

    For each parameter tensor :math:`w` with gradient :math:`g`, global rate
    :math:`\gamma` (``lr``), momentum :math:`m`, weight decay :math:`\beta`,
    trust coefficient :math:`\eta` (Algorithm 1 of arXiv:1708.03888):

    .. math::
        \lambda &= \eta \, \lVert w \rVert \,/\,
                   (\lVert g \rVert + \beta \lVert w \rVert + \epsilon)
                   \quad (\lambda = 1 \text{ if either norm is } 0) \\
        u &= \gamma \lambda \, (g + \beta w) \\
        v &\leftarrow m v + u, \qquad w \leftarrow w - v

    The rate :math:`\gamma` sits inside the momentum buffer, as in the paper:
    when ``lr`` changes, :math:`v` keeps the old rates (``torch.optim.SGD``
    instead multiplies the whole buffer by the current rate; both agree while
    ``lr`` is constant). The buffer starts at :math:`v = 0`.

    * ``nesterov=True``: :math:`v \leftarrow m v + u`, then
      :math:`w \leftarrow w - (u + m v)`, i.e. ``torch.optim.SGD``'s Nesterov
      rule applied to the scaled update :math:`u`. Needs ``momentum > 0``.
    * ``clip=True`` (LARC, apex ``LARC.py``): the layer's effective rate
      :math:`\gamma\lambda` is replaced by :math:`\min(\lambda, \gamma)`
      (apex: ``adaptive_lr = min(adaptive_lr / lr, 1)``, then scaled by
      ``lr``), so no layer steps faster than the global rate; here
      :math:`\lambda` itself is the rate, so choose :math:`\eta` accordingly
      (apex uses 0.02). Where either norm is 0 the rate is :math:`\gamma`
      in both modes. Unlike apex, weight decay still applies there.
    * ``exclude_1d=True``: tensors with ``ndim <= 1`` (biases, norm weights)
      take plain momentum SGD without weight decay: :math:`u = \gamma g`.

    Every option can be set per parameter group, e.g.
    ``[{"params": convs}, {"params": heads, "trust_coefficient": 0.01}]``.
    ``p.grad`` is never modified. Sparse gradients are not supported.

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr: global learning rate :math:`\gamma` (see :func:`hsgd.scaled_lr`).
        momentum: momentum factor :math:`m`, in ``[0, 1)``.
        weight_decay: :math:`\beta` (L2 penalty, inside the adaptive update).
        trust_coefficient: :math:`\eta`, > 0.
        eps: added to the denominator of :math:`\lambda`.
        nesterov: Nesterov momentum, as above.
        exclude_1d: no adaptation and no weight decay for ``ndim <= 1`` tensors.
        clip: LARC clipping, as above.

    Example::

        >>> opt = LARS(model.parameters(), lr=3.2, momentum=0.9, weight_decay=5e-4)
        >>> opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    """

    def __init__(self, params: ParamsT, lr: Number, momentum: float = 0.9,
                 weight_decay: float = 0.0, trust_coefficient: float = 0.001,
                 eps: float = 1e-8, nesterov: bool = False, exclude_1d: bool = True,
                 clip: bool = False) -> None:
        _check_options(lr, momentum, weight_decay, trust_coefficient, eps, nesterov)
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                        trust_coefficient=trust_coefficient, eps=eps,
                        nesterov=nesterov, exclude_1d=exclude_1d, clip=clip)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """Add a group, checking its own overrides like the defaults."""
        index = len(self.param_groups)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_options(group["lr"], group["momentum"], group["weight_decay"],
                       group["trust_coefficient"], group["eps"], group["nesterov"],
                       where=f" in param group {index}")

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in _OPTION_DEFAULTS.items():
                group.setdefault(key, value)

    # override: torch overloads step() (no closure -> None, a closure -> float); one signature
    # with both cannot repeat the overloads
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        """Perform one optimization step; ``closure`` re-evaluates the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LARS does not support sparse gradients: "
                                       "use dense gradients (e.g. nn.Embedding("
                                       "sparse=False)) or torch.optim.SparseAdam")
                update = self._scaled_update(p, p.grad, group)
                p.sub_(self._momentum_step(p, update, group))
        return loss

    @staticmethod
    def _scaled_update(p: Tensor, grad: Tensor, group: dict) -> Tensor:
        """:math:`u` for one tensor, computed out of place (``grad`` untouched)."""
        lr = group["lr"]
        if group["exclude_1d"] and p.ndim <= 1:
            return grad.mul(lr)
        weight_decay = group["weight_decay"]
        direction = grad.add(p, alpha=weight_decay) if weight_decay != 0 else grad
        w_norm = torch.linalg.vector_norm(p)
        g_norm = torch.linalg.vector_norm(grad)
        local_lr = lars_local_lr(w_norm, g_norm, group["trust_coefficient"],
                                 weight_decay, group["eps"])
        if group["clip"]:  # min(lambda, lr) where adaptive, else lr
            adaptive = (w_norm > 0) & (g_norm > 0)
            rate = torch.where(adaptive, torch.clamp(local_lr, max=lr), lr)
        else:
            rate = local_lr * lr
        return direction * rate

    def _momentum_step(self, p: Tensor, update: Tensor, group: dict) -> Tensor:
        """Fold ``update`` into the momentum buffer; return what to subtract."""
        momentum = group["momentum"]
        if momentum == 0:
            return update
        state = self.state[p]
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = state["momentum_buffer"] = update.clone()
        else:
            buf.mul_(momentum).add_(update)
        return update.add(buf, alpha=momentum) if group["nesterov"] else buf
