"""The torch internals hsgd relies on, all in this module; the rest of hsgd uses torch's public API.

Checked against torch 2.13.0 (the pinned version: the tests run with it) and 2.3.1 (the
floor, constraints-floor.txt: each name below read in its source, with the same use; CI
runs the unit tests and the MPI suite at 2 ranks with it). A torch release that renames
one breaks this module only. Three groups: the optimizer's hook tables (a mode cannot run
``Optimizer.__init__``), ``torch.amp.GradScaler``'s handshake with an optimizer that
unscales in its own ``step()``, and two autograd internals (a tensor's version counter,
a callback at the end of backward).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, ClassVar, Dict, Optional

import torch

__all__ = ["init_optimizer_hooks", "state_dict_with_hooks", "load_state_dict_with_hooks", "GradScalerStep",
           "grad_scaler_scale", "under_grad_scaler", "leave_grad_scaler", "version", "queue_end_of_backward"]

# The hook tables of torch.optim.Optimizer.__init__, filled by its register_*_hook methods.
_HOOK_TABLES = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")


# --- optimizer hooks -------------------------------------------------------------------------
# A mode is a torch.optim.Optimizer whose groups, state and defaults are the inner optimizer's
# (hsgd._engine.optimizer), so it cannot run Optimizer.__init__, which would copy the groups;
# torch has no public way to give such a subclass the tables that register_*_hook fill.
def init_optimizer_hooks(optimizer: torch.optim.Optimizer) -> None:
    """What ``torch.optim.Optimizer.__init__`` sets up for hooks, for a subclass that does not
    call it: empty hook tables, and ``step()`` runs the step pre- and post-hooks."""
    for name in _HOOK_TABLES:
        setattr(optimizer, name, OrderedDict())
    optimizer._patch_step_function()


def state_dict_with_hooks(optimizer: torch.optim.Optimizer,
                          make: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    """``make()``, the state dict, between the state-dict hooks registered on ``optimizer``:
    each pre-hook is called with the optimizer, each post-hook with the optimizer and the
    state, and a post-hook's result, unless ``None``, replaces the state."""
    for hook in optimizer._optimizer_state_dict_pre_hooks.values():
        hook(optimizer)
    state = make()
    for post_hook in optimizer._optimizer_state_dict_post_hooks.values():
        result = post_hook(optimizer, state)
        state = state if result is None else result
    return state


def load_state_dict_with_hooks(optimizer: torch.optim.Optimizer, state_dict: Dict[str, Any],
                               load: Callable[[Dict[str, Any]], None]) -> None:
    """``load(state_dict)`` between the load-state-dict hooks registered on ``optimizer``: a
    pre-hook's result, unless ``None``, replaces the state dict; each post-hook is called with
    the optimizer."""
    for pre_hook in optimizer._optimizer_load_state_dict_pre_hooks.values():
        result = pre_hook(optimizer, state_dict)
        state_dict = state_dict if result is None else result
    load(state_dict)
    for hook in optimizer._optimizer_load_state_dict_post_hooks.values():
        hook(optimizer)


# --- GradScaler's handshake ------------------------------------------------------------------
# With _step_supports_amp_scaling, GradScaler.step() calls step() whatever the gradients hold,
# with grad_scale and found_inf set on the optimizer for the call.
class GradScalerStep:
    """Mixin for an optimizer whose ``step()`` unscales the gradients itself: under
    ``GradScaler.step()`` it is always called, with the loss scale and the found-inf flag set
    on the optimizer for that call, and the scaler neither unscales nor skips it."""

    _step_supports_amp_scaling: ClassVar[bool] = True


def grad_scaler_scale(optimizer: torch.optim.Optimizer) -> Optional[float]:
    """The loss scale that ``GradScaler.step()`` set on ``optimizer`` for this step, or ``None``
    (not under ``GradScaler.step()``, or ``unscale_`` ran already)."""
    scale = getattr(optimizer, "grad_scale", None)
    return None if scale is None else float(scale)


def under_grad_scaler(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``GradScaler.step()`` drives ``optimizer``'s running ``step()``."""
    return "found_inf" in vars(optimizer)


def leave_grad_scaler(optimizer: torch.optim.Optimizer) -> None:
    """Remove what ``GradScaler.step()`` set on ``optimizer``, for a ``step()`` that raises
    (the scaler removes it only after a step that returned)."""
    for name in ("found_inf", "grad_scale"):
        vars(optimizer).pop(name, None)


# --- autograd --------------------------------------------------------------------------------
# Tensor._version counts in-place writes; queue_callback is how DDP's reducer runs code at the
# end of the backward pass.
def version(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter, which every in-place write to it increments."""
    return tensor._version


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Call ``callback`` when the running backward pass has finished (from inside one: a hook)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)
