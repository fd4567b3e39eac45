"""``SyncMode``: what every synchronization mode shares, in the manner of torch's ``ModelAverager``.

A mode wraps an inner ``torch.optim`` optimizer (composition, not a
generated subclass) and keeps the ranks' replicas of one model in step. The
base class holds what all modes need and checks what all modes take:

- construction, collective: the common arguments and the mode's own
  (:meth:`SyncMode._check`) are checked on every rank and agreed on, so a
  bad value raises the same :class:`~hsgd.errors.InputError` everywhere; the
  ranks' settings and models must match; parameters and buffers are
  broadcast from rank 0; the tensors the mode averages (``bind = "grad"`` or
  ``"data"``) become views into this rank's slot of a shared window
  (:class:`~hsgd._engine.binding.SlotBinding`);
- it *is* a ``torch.optim.Optimizer`` (composition inside: ``param_groups``,
  ``state`` and ``defaults`` are the inner optimizer's own objects), so torch's
  LR schedulers, ``GradScaler`` and optimizer hooks take the mode itself;
  ``traffic``, ``close()`` and the context manager;
- ``step(closure)`` runs the closure, then the mode's :meth:`SyncMode._step`;
  under ``GradScaler.step()`` (``_step_supports_amp_scaling``) the gradients
  are unscaled here and a non-finite one skips the inner step, so the scaler
  never leaves one rank out of a collective ``step()``.

A subclass sets ``name`` (its ``--sync`` choice in the trainer),
``bind``, ``replicas_differ`` (whether ranks' models differ between
averagings, so that evaluation and checkpoints must average them),
``lockstep`` (whether ``step()`` is collective, so that the ranks run in
step and a caller may add collectives between steps), ``balances``
(whether its averages weight ranks by :attr:`SyncMode.batch_shares`) and
``config_fields`` (the trainer's config fields it takes), and implements
``_check`` and ``_step``. A family with another engine than the shared
window (the parameter box of :mod:`hsgd.remote`, gossip in
:mod:`hsgd.gossip`) overrides ``_build``, ``_teardown`` and
``_route_phases``, and ``shared_state_dict`` / ``load_shared_state_dict``
(the model the trainer evaluates, saves and resumes). Nothing outside a mode
branches on its name.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import ClassVar, Dict, List, Optional, Sequence, Tuple

import torch

from .._core.agree import agree, collective_error
from .._core.checks import check_choice, check_shares
from ..compression import COMPRESSIONS
from ..errors import InputError, InputTypeError, InputValueError
from ..faults import protect
from ..faults.stall import StallInspector
from ..inter_node import STRATEGIES
from ..intra_node import Layout
from ..replicas import averaged_state_dict, broadcast_optimizer_state, broadcast_parameters, check_same_model
from ..topology import Topology
from .binding import SlotBinding
from .named import model_of

__all__ = ["SyncMode", "collective"]


def collective(what: str):
    """Make a mode's method that waits for the other ranks a wait of its stall inspector (named
    ``what`` in reports), as ``step()`` is. Re-entrant: an override that calls ``super()``
    counts once."""
    def wrap(method):
        @functools.wraps(method)
        def watched(self, *args, **kwargs):
            with self.stall.waiting(self.num_steps, what):
                return method(self, *args, **kwargs)
        return watched
    return wrap


def _check_common(optimizer, model, inter_node, compression) -> None:
    if isinstance(optimizer, SyncMode):
        raise InputTypeError(f"optimizer is already a {type(optimizer).__name__}; wrap the inner "
                             f"torch optimizer (its .optimizer) in one mode only")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InputTypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise InputTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_choice("inter_node", inter_node, STRATEGIES)
    check_choice("compression", "none" if compression is None else compression, COMPRESSIONS)
    if isinstance(optimizer, torch.optim.LBFGS):
        raise InputValueError("LBFGS re-evaluates the closure inside step(); wrap a first-order optimizer")
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and id(p) not in trained:
                raise InputValueError("the optimizer holds a parameter that is not a trainable "
                                      "parameter of the model; pass the model whose parameters it trains")


class SyncMode(torch.optim.Optimizer):
    """Base class of the synchronization modes. Construction is collective.

    Args:
        optimizer: the inner ``torch.optim.Optimizer`` over ``model``'s parameters.
        model: the replica on this rank; its trainable parameters are synchronized,
            its parameters and buffers broadcast and compared.
        named_parameters: instead of ``model``, ``(name, parameter)`` pairs
            (``model.named_parameters()``, Horovod's argument); without either, the
            optimizer's parameters. Buffers are then neither broadcast nor compared.
        topology: a :class:`~hsgd.Topology`; default ``Topology.from_comm()`` over the
            world (closed by :meth:`close` when built here).
        inter_node: ``"leader"`` or ``"sharded"`` (see :mod:`hsgd.inter_node`).
        compression: ``None``, ``"fp16"`` or ``"bf16"``: the inter-node sums in 16 bits
            (:mod:`hsgd.compression`).
        broadcast: copy parameters and buffers from rank 0 at construction.
        settings: the subclass's own arguments, checked by :meth:`_check`.
        stall_timeout, stall_abort, stall_abort_after: the stall inspector's
            (:mod:`hsgd.faults.stall`): report the ranks missing from a synchronization after
            ``stall_timeout`` seconds (default ``HSGD_STALL_TIMEOUT`` or 60; 0: off, the abort
            included), abort the job after a wait of ``stall_abort_after`` seconds (default
            ``HSGD_STALL_ABORT_AFTER`` or 600; 0: never), or after the first report with
            ``stall_abort`` (default ``HSGD_STALL_ABORT``).
    """

    name: ClassVar[str] = ""
    bind: ClassVar[str] = "grad"
    replicas_differ: ClassVar[bool] = False
    lockstep: ClassVar[bool] = True
    balances: ClassVar[bool] = False
    config_fields: ClassVar[Tuple[str, ...]] = ("inter_node",)
    # GradScaler.step() then always calls step(), with grad_scale and found_inf set on us
    _step_supports_amp_scaling: ClassVar[bool] = True

    def __init__(self, optimizer, model=None, *, named_parameters=None, topology=None, inter_node="leader",
                 compression=None, broadcast=True, settings: Dict[str, object], stall_timeout=None,
                 stall_abort=None, stall_abort_after=None):
        self._closed = True
        self._shares, self._weights = None, {}
        self._init_optimizer_hooks()
        self._own_topology = topology is None
        self.topology = Topology.from_comm() if topology is None else topology
        try:
            self._setup(optimizer, (model, named_parameters), inter_node, compression, broadcast, settings)
            try:
                self.stall = StallInspector(self.topology.comm, stall_timeout, stall_abort, stall_abort_after)
            except BaseException:
                self._teardown()
                raise
        except BaseException:
            if self._own_topology:
                self.topology.close()
            raise

    @classmethod
    def from_config(cls, optimizer, model, topology, cfg) -> SyncMode:
        """Build this mode from the trainer's config (the fields in ``config_fields``)."""
        return cls(optimizer, model, topology=topology,
                   **{field: getattr(cfg, field) for field in cls.config_fields})

    def _check(self, **settings) -> None:
        """Raise an :class:`~hsgd.errors.InputError` for a bad setting of this mode."""

    def _step(self) -> None:
        raise NotImplementedError

    def _init_optimizer_hooks(self) -> None:
        """What ``torch.optim.Optimizer.__init__`` sets up for hooks (that one would also
        copy the parameter groups: ours are the inner optimizer's)."""
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()  # step() runs the step pre- and post-hooks

    def _setup(self, optimizer, model, inter_node, compression, broadcast, settings) -> None:
        comm = self.topology.comm
        protect(comm)  # from here on: abort, not hang; no files left
        model = model_of(optimizer, *model, comm)  # (model, named_parameters): a module
        error = None
        try:
            _check_common(optimizer, model, inter_node, compression)
            self._check(**settings)
        except InputError as exc:
            error = exc
        agree(comm, error)
        self.compression = None if compression == "none" else compression
        mine = (inter_node, self.compression, sorted(settings.items()))
        if len(set(map(repr, comm.allgather(mine)))) > 1:
            raise collective_error(InputValueError, f"ranks were given different {type(self).__name__} "
                                   "settings; pass the same on every rank")
        check_same_model(model, comm)  # parameters and buffers, before any broadcast
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:  # the same on every rank now
            raise collective_error(InputValueError, "the model has no trainable parameters")
        if broadcast:
            broadcast_parameters(model, comm)
        self.optimizer, self.model, self._params = optimizer, model, params
        self._build(params, inter_node)
        self.num_steps = 0
        self._closed = False

    def _build(self, params, inter_node) -> None:
        """Build what keeps the replicas in step (collective). The default: a shared window
        with two-level averaging (:class:`HierarchicalAverager`), ``params`` bound to its slot."""
        from ..hierarchical.averager import HierarchicalAverager  # the next commit gives it its own engine
        self.averager = HierarchicalAverager(self.topology, self._layout(params), inter_node, self.compression)
        try:
            self._binding = SlotBinding(self.averager, params, self.bind, flags=self.bind == "grad")
        except BaseException:
            self.averager.close()
            raise

    def _teardown(self) -> None:
        """Undo :meth:`_build` (collective); parameters and gradients keep their values."""
        self._binding.unbind()
        self.averager.close()

    def _layout(self, params) -> Layout:
        """One segment entry per parameter, plus the used-flags when gradients are bound."""
        specs = [(p.dtype, p.numel()) for p in params]
        if self.bind == "grad":
            specs.append((torch.float32, len(params)))
        try:
            return Layout(specs)
        except InputTypeError as exc:  # same dtypes on every rank, so the same error
            raise collective_error(InputTypeError, str(exc)) from None

    # --- torch.optim.Optimizer: the inner optimizer's groups, state and defaults ----------
    @property
    def param_groups(self):
        """The inner optimizer's list itself: an LR set through either is seen by both."""
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def add_param_group(self, param_group: dict) -> None:
        raise InputValueError(f"{type(self).__name__} binds its parameters at construction; add the "
                              "group to the inner optimizer before wrapping it")

    def state_dict(self) -> dict:
        """The inner optimizer's state dict, plus ``"hsgd_steps"`` (the step count).
        Runs the state-dict hooks registered on this optimizer."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        state = self.optimizer.state_dict()
        state["hsgd_steps"] = self.num_steps
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, state)
            state = state if result is None else result
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            state_dict = state_dict if result is None else result
        state_dict = dict(state_dict)
        self.num_steps = int(state_dict.pop("hsgd_steps", 0))
        self.optimizer.load_state_dict(state_dict)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    @collective("broadcast_state()")
    def broadcast_state(self, root: int = 0, *, root_rank: Optional[int] = None) -> None:
        """Copy optimizer state and step count from ``root`` (``root_rank``: the same), e.g.
        after it alone loaded a checkpoint. Collective."""
        self._check_open()
        broadcast_optimizer_state(self, self.topology.comm, root, root_rank=root_rank)

    _on_phase = None

    @property
    def on_phase(self):
        """``None`` or ``fn(name, start, end)``, called with the time of each communication phase."""
        return self._on_phase

    @on_phase.setter
    def on_phase(self, fn) -> None:
        self._on_phase = fn
        self._route_phases(fn)

    def _route_phases(self, fn) -> None:
        """Hand the phase callback to the engine that :meth:`_build` made (default: the averager)."""
        self.averager.on_phase = fn

    @collective("shared_state_dict()")
    def shared_state_dict(self) -> dict:
        """The model worth evaluating and saving, on the CPU, the same on every rank. Collective.

        The ranks' average (:func:`~hsgd.replicas.averaged_state_dict`): the
        replicas themselves in synchronous SGD, their consensus in local SGD.
        """
        return averaged_state_dict(self.model, self.topology.comm)

    def _trained_names(self):
        """Names of the trainable parameters, in the order of ``model.parameters()`` (the bound ones)."""
        return [name for name, p in self.model.named_parameters() if p.requires_grad]

    @collective("load_shared_state_dict()")
    def load_shared_state_dict(self, state_dict: dict) -> None:
        """After the model was loaded from a checkpoint, set any state the mode keeps besides
        the replicas from ``state_dict`` (what :meth:`shared_state_dict` returned). Collective."""

    @property
    def traffic(self) -> Dict[str, int]:
        """Bytes this rank moved since construction: ``intra_bytes`` and ``inter_bytes``."""
        return self.averager.traffic.as_dict()

    @property
    def batch_shares(self) -> Optional[List[int]]:
        """Per-rank batch sizes (load balancing, :class:`~hsgd.LoadBalancer`), or ``None``: equal.

        With shares ``b``, an average over ranks weights rank ``r`` by ``b[r]``:
        a gradient average is then ``sum(b_r g_r) / sum(b)``, exactly the
        global batch's gradient when each ``g_r`` is the mean over the rank's
        own batch; a node-level average (local SGD) weights by the node's
        shares. Set the same list on every rank (no communication); only modes
        with ``balances`` take it.
        """
        return None if self._shares is None else list(self._shares)

    @batch_shares.setter
    def batch_shares(self, shares: Optional[Sequence[int]]) -> None:
        if not self.balances:
            raise InputValueError(f"{type(self).__name__} does not weight ranks by batch size; "
                                  f"batch shares need a mode with balances=True (HierarchicalSGD, "
                                  f"HierarchicalLocalSGD)")
        if shares is None:
            self._shares, self._weights = None, {}
            return
        check_shares(shares, self.topology.size)
        node = [shares[r] for r in self.topology.node_ranks]
        mine = shares[self.topology.rank]
        self._shares = [int(b) for b in shares]
        self._weights = {"global": mine * len(shares) / sum(shares), "node": mine * len(node) / sum(node)}

    def _weight(self, level: str) -> float:
        """This rank's factor in a ``level`` average under :attr:`batch_shares` (1 without)."""
        return self._weights.get(level, 1.0)

    # --- the step ----------------------------------------------------------------
    def step(self, closure=None):
        """Run ``closure`` (if any), then the mode's synchronized step. Collective."""
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._skip_inner = False
        with self.stall.waiting(self.num_steps):
            self._step()
        self.num_steps += 1
        return loss

    def _amp_inverse_scale(self) -> float:
        """1 / the loss scale that ``GradScaler.step()`` set on this optimizer for this step
        (``grad_scale``; ``None`` once ``unscale_`` ran), else 1."""
        scale = getattr(self, "grad_scale", None)
        return 1.0 if scale is None else 1.0 / float(scale)

    def _unscale_local(self) -> None:
        """Under ``GradScaler.step()``: unscale this rank's own gradients, and skip the inner
        step if one is not finite (modes whose gradients are local; the scaler checked the
        same gradients, so it skips its update alike)."""
        if not hasattr(self, "found_inf"):
            return
        inverse = self._amp_inverse_scale()
        grads = [p.grad for p in self._params if p.grad is not None]
        for grad in grads if inverse != 1.0 else ():
            grad.mul_(inverse)
        self._skip_inner = not all(bool(torch.isfinite(g).all()) for g in grads)

    def _optimizer_step(self) -> None:
        """The inner optimizer's step, unless :meth:`_unscale_local` found a non-finite gradient."""
        if not self._skip_inner:
            self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._check_open()
        self.optimizer.zero_grad(set_to_none)

    def synchronize(self) -> None:
        raise RuntimeError(f"{type(self).__name__} has no synchronize(): it averages "
                           f"{'gradients' if self.bind == 'grad' else 'parameters'} inside step()")

    # --- life cycle ----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed; build a new one to keep training")

    def close(self) -> None:
        """Free the shared window (collective). Gradients and parameters keep their values.

        ``p.grad`` and ``p.data`` get private copies; any other reference taken
        earlier to them (a saved ``p.grad``, a ``state_dict()`` of the model in
        a mode that binds parameters) pointed into the window and must not be used after.
        """
        if self._closed:
            return
        self._closed = True
        self.stall.close()
        self._teardown()
        if self._own_topology:
            self.topology.close()

    def __enter__(self) -> SyncMode:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({type(self.optimizer).__name__}, "
                f"inter_node={self.averager.inter_node!r}, {self.topology})")
