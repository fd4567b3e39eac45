"""``HierarchicalSGD``: any torch optimizer, synchronized in two levels.

The wrapper holds an inner ``torch.optim`` optimizer (composition, not a
generated subclass) and a :class:`~hsgd.hierarchical.averager.HierarchicalAverager`.

``average="gradients"`` (default) is exact synchronous SGD: ``step()``
averages the gradients over all ranks, inside the node through shared memory
and across nodes with MPI, then runs the inner step. With ``k`` ranks on one
node this is ``k``-rank synchronous SGD, bit for bit up to summation order.

``average="parameters"`` is hierarchical local SGD (Lin et al., ICLR 2020,
https://arxiv.org/abs/1808.07217): every rank steps on its own gradients; the
parameters are then averaged within the node when ``t % intra_period == 0``
and over all ranks when ``t % (intra_period * inter_period) == 0``, where
``t`` counts the steps taken before this one (0, 1, 2, ...). These are the
semantics of torch's ``HierarchicalModelAverager``; periods of 1 average all
parameters after every step.

Gradient accumulation needs nothing special: backward never communicates, so
call ``backward()`` several times and ``step()`` once. With
``backward_passes_per_step=N`` the summed gradient is also divided by ``N``
(folded into the averaging), giving the mean over all ``N * world`` micro-batches.

Example::

    >>> model = Net()
    >>> opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model)
    >>> for x, y in loader:
    ...     opt.zero_grad()
    ...     loss_fn(model(x), y).backward()
    ...     opt.synchronize()                            # optional: average now,
    ...     torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    ...     with opt.skip_synchronize():                 # then step without
    ...         opt.step()                               # averaging again
    >>> opt.close()

LR schedulers attach to the inner optimizer: ``Scheduler(opt.optimizer, ...)``.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import torch

from .._engine.agree import agree, collective_error
from .._engine.binding import SlotBinding
from .averager import HierarchicalAverager
from ..broadcast import broadcast_optimizer_state, broadcast_parameters, check_same_model
from ..errors import InputError, InputTypeError, InputValueError
from ..inter_node import STRATEGIES
from ..intra_node import Layout
from ..topology import Topology

__all__ = ["HierarchicalSGD", "AVERAGE_MODES"]

logger = logging.getLogger(__name__)

AVERAGE_MODES = ("gradients", "parameters")


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputValueError(f"Invalid {name} value: {value!r}; use an integer >= 1")


def _validate(optimizer, model, inter_node, average, intra_period, inter_period,
              backward_passes_per_step) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InputTypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise InputTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if inter_node not in STRATEGIES:
        raise InputValueError(f"Invalid inter_node value: {inter_node!r}; choose one of {list(STRATEGIES)}")
    if average not in AVERAGE_MODES:
        raise InputValueError(f"Invalid average value: {average!r}; choose one of {list(AVERAGE_MODES)}")
    _positive_int("intra_period", intra_period)
    _positive_int("inter_period", inter_period)
    _positive_int("backward_passes_per_step", backward_passes_per_step)
    if isinstance(optimizer, torch.optim.LBFGS):
        raise InputValueError("LBFGS re-evaluates the closure inside step(); wrap a first-order optimizer")
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and id(p) not in trained:
                raise InputValueError("the optimizer holds a parameter that is not a trainable "
                                      "parameter of the model; pass the model whose parameters it trains")


class HierarchicalSGD:
    """Wraps ``optimizer`` so that every ``step()`` is synchronized over ``topology``.

    Args:
        optimizer: the inner ``torch.optim.Optimizer`` over ``model``'s parameters.
        model: the replica on this rank; its trainable parameters are averaged.
        topology: a :class:`~hsgd.Topology`; default ``Topology.from_comm()``
            (closed by :meth:`close` when built here).
        inter_node: ``"leader"`` or ``"sharded"`` (see :mod:`hsgd.inter_node`).
        average: ``"gradients"`` (synchronous SGD) or ``"parameters"`` (local SGD).
        intra_period, inter_period: parameter-averaging periods (``"parameters"`` only).
        backward_passes_per_step: divide the accumulated gradient by this.
        broadcast: copy parameters and buffers from rank 0 at construction.

    Construction is collective. It raises the same error on every rank if the
    ranks' models differ (names, shapes, dtypes) or the settings differ.
    """

    def __init__(self, optimizer, model, *, topology=None, inter_node="leader",
                 average="gradients", intra_period=1, inter_period=1,
                 backward_passes_per_step=1, broadcast=True):
        self._closed = True
        self._own_topology = topology is None
        self.topology = Topology.from_comm() if topology is None else topology
        try:
            self._setup(optimizer, model, inter_node, average, intra_period,
                        inter_period, backward_passes_per_step, broadcast)
        except BaseException:
            if self._own_topology:
                self.topology.close()
            raise

    def _setup(self, optimizer, model, inter_node, average, intra_period,
               inter_period, backward_passes_per_step, broadcast) -> None:
        comm = self.topology.comm
        settings = (inter_node, average, intra_period, inter_period, backward_passes_per_step)
        error = None
        try:
            _validate(optimizer, model, *settings)
        except InputError as exc:
            error = exc
        agree(comm, error)
        if len(set(map(repr, comm.allgather(settings)))) > 1:
            raise collective_error(InputValueError, "ranks were given different HierarchicalSGD "
                                   "settings (inter_node, average, periods); pass the same on every rank")
        if average == "gradients" and (intra_period, inter_period) != (1, 1):
            warnings.warn("intra_period and inter_period only apply to "
                          "average='parameters'; they are ignored", stacklevel=3)
        check_same_model(model, comm)  # parameters and buffers, before any broadcast
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:  # the same on every rank now
            raise collective_error(InputValueError, "the model has no trainable parameters")
        gradients = average == "gradients"
        specs = [(p.dtype, p.numel()) for p in params] + ([(torch.float32, len(params))] if gradients else [])
        try:
            layout = Layout(specs)
        except InputTypeError as exc:  # same dtypes on every rank, so the same error
            raise collective_error(InputTypeError, str(exc)) from None
        if broadcast:
            broadcast_parameters(model, comm)
        self.optimizer, self.model = optimizer, model
        self.average, self.intra_period, self.inter_period = average, intra_period, inter_period
        self.backward_passes_per_step = backward_passes_per_step
        self.averager = HierarchicalAverager(self.topology, layout, inter_node)
        try:
            self._binding = SlotBinding(self.averager, params, "grad" if gradients else "data",
                                        flags=gradients)
        except BaseException:
            self.averager.close()
            raise
        self.num_steps = 0
        self._synchronized = False
        self._skip = False
        self._closed = False

    # --- torch.optim.Optimizer look-alike -------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def state_dict(self) -> dict:
        """The inner optimizer's state dict, plus ``"hsgd_steps"`` (the step count)."""
        state = self.optimizer.state_dict()
        state["hsgd_steps"] = self.num_steps
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        self.num_steps = int(state_dict.pop("hsgd_steps", 0))
        self.optimizer.load_state_dict(state_dict)

    def broadcast_state(self, root: int = 0) -> None:
        """Copy optimizer state and step count from ``root`` (after it loaded a checkpoint)."""
        self._check_open()
        broadcast_optimizer_state(self.optimizer, self.topology.comm, root)
        self.num_steps = self.topology.comm.bcast(self.num_steps, root=root)

    # --- synchronization ---------------------------------------------------------
    def synchronize(self) -> None:
        """Average the gradients over all ranks now (``average="gradients"`` only).

        A second call before ``step()`` or ``zero_grad()`` does nothing.
        """
        self._check_open()
        if self.average != "gradients":
            raise RuntimeError("synchronize() averages gradients; with average='parameters' "
                               "the parameters are averaged inside step()")
        if self._synchronized:
            return
        self._binding.gather()
        self.averager.average("global", 1.0 / self.backward_passes_per_step)
        self._binding.scatter()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside this block ``step()`` does not average (call ``synchronize()`` first)."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def step(self, closure=None):
        """Average (gradients or, periodically, parameters) and step. Collective."""
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.average == "gradients":
            if self._skip and not self._synchronized:
                warnings.warn("step() inside skip_synchronize() without synchronize(): "
                              "each rank steps on its own gradients", stacklevel=2)
            elif not self._skip and not self._synchronized:
                self.synchronize()
            self.optimizer.step()
        else:
            self.optimizer.step()
            self._average_parameters()
        self._synchronized = False
        self.num_steps += 1
        return loss

    def _average_parameters(self) -> None:
        level = self.averaging_level(self.num_steps)
        if level is None:
            return
        self._binding.gather()
        self.averager.average(level)
        self._binding.scatter()

    def averaging_level(self, step: int):
        """``"global"``, ``"node"`` or ``None``: what step ``step`` averages (parameters mode)."""
        if step % (self.intra_period * self.inter_period) == 0:
            return "global"
        if step % self.intra_period == 0:
            return "node"
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients in place (they must stay views into shared memory)."""
        self._check_open()
        self._synchronized = False
        if self.average == "gradients":
            self._binding.zero_(set_to_none)
        else:
            self.optimizer.zero_grad(set_to_none)

    # --- life cycle ----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("HierarchicalSGD is closed; build a new one to keep training")

    def close(self) -> None:
        """Free the shared window (collective). Gradients and parameters keep their values.

        ``p.grad`` and ``p.data`` get private copies; any other reference taken
        earlier to them (a saved ``p.grad``, a ``state_dict()`` of the model in
        parameters mode) pointed into the window and must not be used after.
        """
        if self._closed:
            return
        self._closed = True
        self._binding.unbind()
        self.averager.close()
        if self._own_topology:
            self.topology.close()

    def __enter__(self) -> "HierarchicalSGD":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"HierarchicalSGD({type(self.optimizer).__name__}, average={self.average!r}, "
                f"inter_node={self.averager.inter_node!r}, {self.topology})")
