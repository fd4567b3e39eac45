"""``SyncMode``: what every synchronization mode shares, in the manner of torch's ``ModelAverager``.

A mode wraps an inner ``torch.optim`` optimizer (composition, not a generated
subclass) and keeps the ranks' replicas of one model in step. The base class checks
and agrees, wraps, and owns the life cycle; the machinery is the family's *engine*
(:mod:`hsgd._engine.protocols`). It *is* a ``torch.optim.Optimizer``
(:class:`~hsgd._engine.optimizer.InnerOptimizer`), so torch's LR schedulers,
``GradScaler`` and optimizer hooks take the mode itself.

Invariants: construction is collective, and its checks (the optimizer, the model and the
mode's :attr:`SyncMode.Settings`) are agreed on, so a bad value raises the same
:class:`~hsgd.errors.InputError` on every rank; parameters and buffers
are broadcast from rank 0; under ``GradScaler.step()`` a non-finite gradient skips the
inner step on every rank, so the scaler never leaves one rank out of a
collective ``step()``; nothing outside a mode branches on its name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from typing import Any, Callable, ClassVar, ContextManager, Dict, List, Optional, Sequence, Tuple, TypeVar

import torch

from .._core.agree import check_all, collective_error
from .._core.closable import Closable
from .._core.meter import Meter, PhaseCallback
from .._core.settings import Settings as ModeSettings
from ..errors import InputTypeError, InputValueError
from ..faults import protect
from ..faults.stall import Stall, StallInspector, StallSettings
from ..replicas import averaged_state_dict, broadcast_optimizer_state, broadcast_parameters, check_same_model
from ..topology import Topology
from .binding import SlotBinding
from .named import NamedParameterPairs, model_of
from .optimizer import InnerOptimizer
from .protocols import Engine
from .torch_compat import GradScalerStep, grad_scaler_scale, under_grad_scaler
from .weights import BatchShares

__all__ = ["SyncMode", "collective"]

_Method = TypeVar("_Method", bound=Callable[..., Any])


def collective(what: str) -> Callable[[_Method], _Method]:
    """Make a mode's method that waits for the other ranks a wait of its stall inspector (named
    ``what`` in reports), as ``step()`` is. Re-entrant: an override that calls ``super()``
    counts once."""
    def wrap(method: _Method) -> _Method:
        @functools.wraps(method)
        def watched(self: SyncMode, *args: Any, **kwargs: Any) -> Any:
            with self.stall.waiting(self.num_steps, what):
                return method(self, *args, **kwargs)
        return watched  # type: ignore[return-value]  # functools.wraps keeps the signature
    return wrap


def _check_common(optimizer, model) -> None:
    if isinstance(optimizer, SyncMode):
        raise InputTypeError(f"optimizer is already a {type(optimizer).__name__}; wrap the inner "
                             f"torch optimizer (its .optimizer) in one mode only")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InputTypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise InputTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise InputValueError("LBFGS re-evaluates the closure inside step(); wrap a first-order optimizer")
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and id(p) not in trained:
                raise InputValueError("the optimizer holds a parameter that is not a trainable "
                                      "parameter of the model; pass the model whose parameters it trains")


def _check_stall(stall, comm) -> None:
    if stall is None or isinstance(stall, StallSettings):
        return
    if not isinstance(stall, StallInspector):
        raise InputTypeError(f"stall must be a hsgd.faults.StallSettings, a hsgd.faults.StallInspector or None, "
                             f"got {type(stall).__name__}")
    from mpi4py import MPI

    if stall.closed or MPI.Comm.Compare(stall.comm, comm) not in (MPI.IDENT, MPI.CONGRUENT):
        raise InputValueError("stall must be an open StallInspector over the mode's ranks "
                              "(built on topology.comm)")


class SyncMode(InnerOptimizer, GradScalerStep, Closable):
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
        broadcast: copy parameters and buffers from rank 0 at construction.
        settings: the mode's settings as one :attr:`Settings` object, instead of its keyword
            arguments.
        **kwargs: the mode's settings, each a field of its :attr:`Settings` (see there);
            checked and compared across ranks.
        stall: the stall inspector (``hsgd.faults.stall``), which reports the ranks missing
            from a synchronization that waits too long and ends a job that waits for good:
            ``None`` (the mode's own, set by ``HSGD_STALL_TIMEOUT``, ``HSGD_STALL_ABORT``,
            ``HSGD_STALL_ABORT_AFTER`` and ``HSGD_STALL_ABORT_PACE``), a :class:`~hsgd.faults.stall.StallSettings` (the
            mode's own, e.g. ``StallSettings(timeout=30)``), or a
            :class:`~hsgd.faults.stall.StallInspector` built over the same ranks
            (``topology.comm``) by the caller, who also waits under it (the trainer, whose own
            collectives it watches) and closes it after the mode.

    Attributes:
        settings: the mode's :attr:`Settings`, as given.
        engine: the family's :class:`~hsgd._engine.protocols.Engine` (its ``binding`` and, for the
            hierarchical family, ``averager`` and ``overlap``), for tools and tests.
        meter: the :class:`~hsgd._core.meter.Meter` this mode makes and gives its engine at
            construction: the bytes moved and the communication phases of everything below it.
        stall: the :class:`~hsgd.faults.stall.StallInspector` that watches this mode's waits.
    """

    @dataclasses.dataclass(frozen=True)
    class Settings(ModeSettings):
        """The mode's settings (none here): a frozen dataclass, one field per keyword argument."""

    settings: ModeSettings
    # A subclass sets these, declares its Settings and implements _make_engine and _step.
    name: ClassVar[str] = ""                # its --sync choice in the trainer
    replicas_differ: ClassVar[bool] = False  # models differ between averagings: evaluation and checkpoints average them
    lockstep: ClassVar[bool] = True         # step() is collective: a caller may add collectives between steps
    balances: ClassVar[bool] = False        # its averages weight ranks by batch_shares
    finite_guard: ClassVar[bool] = False    # gradients_finite() says (the same on every rank) if averages are finite
    # GradScalerStep: GradScaler.step() always calls step(), with grad_scale and found_inf set on us

    def __init__(self, optimizer: torch.optim.Optimizer, model: Optional[torch.nn.Module] = None, *,
                 named_parameters: Optional[NamedParameterPairs] = None, topology: Optional[Topology] = None,
                 broadcast: bool = True, stall: Stall = None, settings: Optional[ModeSettings] = None,
                 **kwargs: Any) -> None:
        self._init_optimizer_hooks()
        self.meter = Meter()
        self._own_topology = topology is None
        self.topology = Topology.from_comm() if topology is None else topology
        self._shares = BatchShares(self.topology)
        self._own_stall = not isinstance(stall, StallInspector)
        with contextlib.ExitStack() as undo:  # if the constructor fails: free what it built, in reverse
            if self._own_topology:
                undo.callback(self.topology.close)
            check_all(self.topology.comm, _check_stall, stall, self.topology.comm)
            self._setup(optimizer, (model, named_parameters), broadcast, (settings, kwargs))  # the engine last
            undo.callback(self.engine.close)
            if isinstance(stall, StallInspector):
                self.stall = stall
            else:
                own = stall or StallSettings()
                self.stall = StallInspector(self.topology.comm, own.timeout, own.abort, own.abort_after,
                                            own.abort_pace)
            undo.pop_all()
        self._opened()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A mode that declares its own ``Settings`` gets its fields as keyword arguments in
        its signature (``help()``, the API reference) and listed in the settings' docstring."""
        super().__init_subclass__(**kwargs)
        own = cls.Settings
        if "Settings" in cls.__dict__ and dataclasses.fields(own) and "Fields:" not in (own.__doc__ or ""):
            own.__doc__ = f"{inspect.cleandoc(own.__doc__ or '')}\n\nFields:\n\n{own.describe()}\n"
        if "__init__" in cls.__dict__:
            return

        def __init__(self: SyncMode, *args: Any, **kw: Any) -> None:  # no defaults of its own: Sphinx
            SyncMode.__init__(self, *args, **kw)                       # takes them from __signature__

        base = inspect.signature(SyncMode.__init__)
        fields = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
                  for f in dataclasses.fields(own)]
        params = [p for p in base.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        __init__.__signature__ = base.replace(parameters=params + fields)  # type: ignore[attr-defined]
        __init__.__qualname__, __init__.__module__ = f"{cls.__qualname__}.__init__", cls.__module__
        cls.__init__ = __init__  # type: ignore[method-assign]

    def _make_engine(self, params: List[torch.nn.Parameter]) -> Engine:
        """Build the family's engine over ``params`` (collective), given :attr:`meter`."""
        raise NotImplementedError

    def _step(self) -> None:
        raise NotImplementedError

    def _setup(self, optimizer: torch.optim.Optimizer,
               given: Tuple[Optional[torch.nn.Module], Optional[NamedParameterPairs]],
               broadcast: bool, settings: Tuple[Optional[ModeSettings], Dict[str, Any]]) -> None:
        comm = self.topology.comm
        protect(comm)  # from here on: abort, not hang; no files left
        model = model_of(optimizer, *given, comm)  # (model, named_parameters): a module

        def check():
            _check_common(optimizer, model)
            self.settings = self._settings(*settings)
            self.settings.validate()
        check_all(comm, check)
        mine = sorted(self.settings.agreed())
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
        self.num_steps = 0
        self.engine = self._make_engine(params)

    def _settings(self, given: Optional[ModeSettings], kwargs: Dict[str, Any]) -> ModeSettings:
        """The mode's settings from ``settings=`` or from its keyword arguments (local)."""
        name = type(self).__name__
        if given is None:
            return self.Settings.build(kwargs, name)
        if kwargs:
            raise InputTypeError(f"pass {name}'s settings either as settings= or as keyword arguments "
                                 f"({', '.join(kwargs)}), not both")
        if type(given) is not self.Settings:
            raise InputTypeError(f"settings must be a {name}.Settings, got {type(given).__qualname__}")
        return given

    @property
    def _binding(self) -> SlotBinding:
        return self.engine.binding

    @collective("broadcast_state()")
    def broadcast_state(self, root: int = 0, *, root_rank: Optional[int] = None) -> None:
        """Copy optimizer state and step count from ``root`` (``root_rank``: the same), e.g.
        after it alone loaded a checkpoint. Collective."""
        self._check_open()
        broadcast_optimizer_state(self, self.topology.comm, root, root_rank=root_rank)

    @property
    def on_phase(self) -> Optional[PhaseCallback]:
        """``None`` or ``fn(name, start, end)``, called with the time of each communication phase."""
        return self.meter.on_phase

    @on_phase.setter
    def on_phase(self, fn: Optional[PhaseCallback]) -> None:
        self.meter.on_phase = fn

    @property
    def traffic(self) -> Dict[str, int]:
        """Bytes this rank moved since construction, as ``intra_bytes`` and ``inter_bytes``."""
        return self.meter.as_dict()

    # --- the model the trainer evaluates and saves -------------------------------------------
    @collective("shared_state_dict()")
    def shared_state_dict(self) -> Dict[str, Any]:
        """The model worth evaluating and saving, on the CPU, the same on every rank. Collective.

        The ranks' average (``hsgd.replicas.averaged_state_dict``): the
        replicas themselves in synchronous SGD, their consensus in local SGD.
        """
        return averaged_state_dict(self.model, self.topology.comm)

    def _trained_names(self) -> List[str]:
        """Names of the trainable parameters, in the order of ``model.parameters()`` (the bound ones)."""
        return [name for name, p in self.model.named_parameters() if p.requires_grad]

    def rank_state_dict(self) -> Optional[Dict[str, Any]]:
        """The entries of :meth:`state_dict` that differ between ranks although the replicas do not
        (a codec's error feedback), for a checkpoint that saves one rank's :meth:`state_dict` and
        gathers these from every rank; ``None``: none."""
        return None

    @collective("load_shared_state_dict()")
    def load_shared_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """After the model was loaded from a checkpoint, set any state the mode keeps besides
        the replicas from ``state_dict`` (what :meth:`shared_state_dict` returned). Collective."""

    # --- a step's weighting ------------------------------------------------------------------
    @property
    def batch_shares(self) -> Optional[List[int]]:
        """Per-rank batch sizes (load balancing, :class:`~hsgd.LoadBalancer`), or ``None``: equal.

        With shares ``b``, an average over ranks weights rank ``r`` by ``b[r]``
        (:mod:`hsgd._engine.weights`); a node-level average (local SGD) weights
        by the node's shares. Set the same list on every rank (no
        communication); only modes with ``balances`` take it.
        """
        return None if self._shares.shares is None else list(self._shares.shares)

    @batch_shares.setter
    def batch_shares(self, shares: Optional[Sequence[int]]) -> None:
        if not self.balances:
            raise InputValueError(f"{type(self).__name__} does not weight ranks by batch size; "
                                  f"batch shares need a mode with balances=True (HierarchicalSGD, "
                                  f"HierarchicalLocalSGD)")
        self._shares.set(shares)

    def step_weight(self, level: str) -> float:
        """This step's factor on this rank's values in a ``level`` average: its batch share
        times the AMP inverse loss scale (:mod:`hsgd._engine.weights`)."""
        return self._shares.factor(level) * self._amp_inverse_scale()

    def _amp_inverse_scale(self) -> float:
        """1 / the loss scale that ``GradScaler.step()`` set on this optimizer for this step
        (``grad_scale``; ``None`` once ``unscale_`` ran), else 1."""
        scale = grad_scaler_scale(self)
        return 1.0 if scale is None else 1.0 / scale

    # --- the step ----------------------------------------------------------------------------
    # override: torch overloads step() (no closure -> None, a closure -> float); one signature
    # with both cannot repeat the overloads
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        """Run ``closure`` (if any), then the mode's synchronized step (``_step``), watched by the
        stall inspector. Collective."""
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

    @property
    def _under_scaler(self) -> bool:
        """Whether ``GradScaler.step()`` drives this step (it set ``found_inf`` on us)."""
        return under_grad_scaler(self)

    def _unscale_local(self) -> None:
        """Under ``GradScaler.step()``: unscale this rank's own gradients, and skip the inner
        step if one is not finite (modes whose gradients are local; the scaler checked the
        same gradients, so it skips its update too)."""
        if not self._under_scaler:
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
        """The inner optimizer's ``zero_grad``: reset the gradients (to ``None`` by default)."""
        self._check_open()
        self.optimizer.zero_grad(set_to_none)

    # --- capabilities, declared rather than probed -------------------------------------------
    def no_sync(self) -> ContextManager[None]:
        """A block in which backward does not average. Only ``HierarchicalSGD(overlap=True)``
        averages in backward; elsewhere this is a null context."""
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        """Average the gradients before :meth:`step` (``HierarchicalSGD``, Horovod's protocol).
        Modes that average inside ``step()`` have none: raises ``RuntimeError``."""
        raise RuntimeError(f"{type(self).__name__} has no synchronize(): it averages "
                           f"{'gradients' if self.engine.binding.what == 'grad' else 'parameters'} "
                           "inside step()")

    def gradients_finite(self) -> bool:
        """Whether every averaged gradient is finite, the same on every rank (modes with
        ``finite_guard``)."""
        raise RuntimeError(f"{type(self).__name__} does not average gradients before its step; "
                           "gradients_finite() needs a mode with finite_guard=True (HierarchicalSGD)")

    # --- life cycle --------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed; build a new one to keep training")

    def close(self) -> None:
        """Free the engine (collective). Gradients and parameters keep their values.

        ``p.grad`` and ``p.data`` get private copies; any other reference taken
        earlier to them (a saved ``p.grad``, a ``state_dict()`` of the model in
        a mode that binds parameters) pointed into shared memory and must not be used after.
        """
        super().close()

    def _close(self) -> None:
        if self._own_stall:
            self.stall.close()
        self.engine.close()
        if self._own_topology:
            self.topology.close()

    def __repr__(self) -> str:
        settings = self.engine.describe() if hasattr(self, "engine") else None
        middle = f", {settings}" if settings else ""
        return f"{type(self).__name__}({type(self.optimizer).__name__}{middle}, {self.topology})"
