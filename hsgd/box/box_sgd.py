"""The parameter box: global weights in remote memory, and two modes that train against them.

Soft Memory Box (``shared/PAPERS.md``, section 5) keeps the global weights ``W_g`` in a
memory server that workers read and accumulate into without the server's CPU; the
workers never wait for each other. Here ``W_g`` is a
:class:`~hsgd.remote.memory.RemoteMemory` region (one shard per node leader, in the
order of ``model.parameters()``), and each rank's model is its local replica ``W_x``.
:class:`ElasticSGD` (``--sync elastic``) is SEASGD as in ShmCaffe; :class:`AsyncSGD`
(``--sync async``) is asynchronous SGD with any torch optimizer, its state local.

Invariants: neither has a barrier or collective in its step, so a slow rank slows
only itself; construction and :meth:`~BoxMode.close` are collective; ``W_g`` starts as
rank 0's parameters (after the usual broadcast). docs/box.md.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional

import torch

from .._core.meter import Meter, Phase
from .._core.settings import Integer, Real, setting
from .._engine.binding import FlatSlot, SlotBinding
from .._engine.mode import SyncMode, collective
from .._engine.protocols import Engine
from ..errors import InputValueError
from ..remote.memory import RemoteMemory
from ..topology import Topology

__all__ = ["ElasticSGD", "AsyncSGD", "BoxMode", "BoxEngine"]


class BoxEngine(Engine):
    """``W_x``, the flat replica the parameters are views into, and ``W_g``, a
    :class:`~hsgd.remote.memory.RemoteMemory` region of the same size (one shard per node
    leader), starting as rank 0's ``W_x``. Collective to build and to close.

    The local parameters are views into one flat CPU buffer ``W_x`` (CPU parameters
    without a copy; others are staged), so reads of ``W_g`` land in them directly. The
    region counts the bytes this rank reads, writes and accumulates in ``meter`` (the
    mode's): its own node's shards as ``intra``, the others as ``inter``.
    """

    def __init__(self, topology: Topology, params: List[torch.nn.Parameter], who: str, meter: Meter) -> None:
        self.meter = meter
        self.slot = FlatSlot(params, who)
        with contextlib.ExitStack() as undo:  # if the region cannot be built: unbind the parameters
            self.binding = SlotBinding(self.slot, params, "data")  # copies the values in, binds views
            undo.callback(self.binding.unbind)
            self.local = self.slot.buffer  # W_x
            self.box = RemoteMemory(topology.comm, self.local.numel(), dtype=self.slot.dtype, topology=topology,
                                    meter=meter)
            undo.pop_all()
        if topology.rank == 0:
            self.box.write(0, self.local)  # W_g starts as rank 0's parameters (everyone's, after broadcast)
        topology.comm.Barrier()
        self._opened()

    def describe(self) -> str:
        return repr(self.box)

    def _close(self) -> None:
        self.binding.unbind()
        self.box.close()


class BoxMode(SyncMode):
    """What :class:`ElasticSGD` and :class:`AsyncSGD` share: ``W_g`` in a RemoteMemory region
    (:class:`BoxEngine`)."""

    replicas_differ = True
    lockstep = False  # step() waits for nobody: ranks drift apart
    engine: BoxEngine

    def _make_engine(self, params: List[torch.nn.Parameter]) -> BoxEngine:
        return BoxEngine(self.topology, params, type(self).__name__, self.meter)

    @property
    def box(self) -> RemoteMemory:
        """``W_g``: the engine's region."""
        return self.engine.box

    @property
    def local(self) -> torch.Tensor:
        """``W_x``: this rank's flat replica; the parameters are views into it."""
        return self.engine.local

    @property
    def _slot(self) -> FlatSlot:
        return self.engine.slot

    @collective("global_parameters()")  # one-sided, but it waits for every owner
    def global_parameters(self) -> List[torch.Tensor]:
        """A fresh read of ``W_g``, as tensors shaped (and placed) like ``model.parameters()``."""
        self._check_open()
        self._finish_round()
        flat = self.box.read(0, torch.empty_like(self.local))
        return [flat[off:off + p.numel()].view(p.shape).to(p.device, copy=True)
                for p, (_, off) in zip(self._binding.params, self._slot.layout.places)]

    @collective("load_global_parameters()")
    def load_global_parameters(self, tensors: Iterable[torch.Tensor], replicas: bool = True) -> None:
        """Set ``W_g`` (and with ``replicas`` this rank's parameters) to ``tensors``. Collective."""
        self._check_open()
        given = list(tensors)
        params = self._binding.params
        if len(given) != len(params) or any(t.shape != p.shape for t, p in zip(given, params)):
            raise InputValueError("load_global_parameters: expected one tensor per trainable parameter, "
                                  "shaped like it, in the order of model.parameters()")
        self._finish_round()
        comm = self.topology.comm
        comm.Barrier()  # nobody reads or accumulates the old W_g any more
        if self.topology.rank == 0:
            self.box.write(0, torch.cat([t.detach().reshape(-1).to("cpu", self.local.dtype) for t in given]))
        if replicas:
            with torch.no_grad():
                for p, t in zip(params, given):
                    p.data.copy_(t)
            self._binding.gather()
        comm.Barrier()

    def _finish_round(self) -> None:
        """Complete this rank's pending accumulate into ``W_g``, if any."""
        self.box.accumulate_wait()

    @collective("shared_state_dict()")
    def shared_state_dict(self) -> Dict[str, Any]:
        """The model with ``W_g`` as its parameters (buffers averaged over ranks). Collective.

        Every rank's last update is in ``W_g`` before anyone reads it, however
        far apart the ranks' steps were.
        """
        self._finish_round()
        self.topology.comm.Barrier()
        state = super().shared_state_dict()
        for name, value in zip(self._trained_names(), self.global_parameters()):
            state[name] = value.to("cpu")
        return state

    @collective("load_shared_state_dict()")
    def load_shared_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Set ``W_g`` from a checkpoint's model; each rank's replica stays as loaded. Collective."""
        self.load_global_parameters([state_dict[name] for name in self._trained_names()], replicas=False)

    def _phase(self) -> Phase:
        """A round with ``W_g`` as a phase: ``"intra"`` (every owner on this node) or ``"inter"``."""
        return self.meter.phase("intra" if len(self.box.node_owners) == len(self.box.owners) else "inter")


class ElasticSGD(BoxMode):
    """Wraps ``optimizer``: local steps, and an elastic pull towards ``W_g`` every ``tau`` steps.

    Args:
        optimizer, model, topology, broadcast, stall: see :class:`~hsgd._engine.mode.SyncMode`.
        **settings: the fields of :class:`ElasticSGD.Settings` (``alpha``, ``tau``).

    Every ``tau`` steps a worker reads ``W_g``, computes ``delta = alpha * (W_x - W_g)``,
    sets ``W_x -= delta`` and accumulates ``W_g += delta``. The accumulate is issued and
    completed at the start of the next round (or at :meth:`close`), so it overlaps the
    local steps in between where the network moves data by itself.

    Example::

        >>> opt = hsgd.ElasticSGD(torch.optim.SGD(model.parameters(), lr=0.05), model, alpha=0.2)
        >>> for x, y in loader:          # ranks may run different numbers of steps
        ...     opt.zero_grad()
        ...     loss_fn(model(x), y).backward()
        ...     opt.step()
        >>> weights = opt.global_parameters()   # W_g, in the order of model.parameters()
        >>> opt.close()
    """

    @dataclass(frozen=True)
    class Settings(BoxMode.Settings):
        """:class:`ElasticSGD`'s settings."""

        alpha: float = setting(0.2, "elastic moving rate in [0, 1] (0 leaves the global weights untouched)",
                               Real(0, 1, hint="(SEASGD uses 0.1 to 0.5)"))
        tau: int = setting(1, "steps between elastic rounds", Integer())

    settings: Settings
    name = "elastic"
    _delta: Optional[torch.Tensor] = None

    def _step(self) -> None:
        self._unscale_local()
        self._optimizer_step()
        if (self.num_steps + 1) % self.settings.tau:
            return
        with self._phase():
            self._binding.gather()  # staged (non-CPU) parameters into W_x
            self._finish_round()  # the last round's delta is in W_g: its buffer is free again
            if self._delta is None:
                self._delta = torch.empty_like(self.local)
            delta = self.box.read(0, self._delta).sub_(self.local).mul_(-self.settings.alpha)  # alpha * (W_x - W_g)
            self.local.sub_(delta)
            self.box.accumulate_start(0, delta)  # delta stays untouched until the next round completes it
            self._binding.scatter()

    def _close(self) -> None:
        self._finish_round()
        self.topology.comm.Barrier()  # every rank's last delta is in W_g before anyone frees it
        super()._close()


class AsyncSGD(BoxMode):
    """Wraps ``optimizer``: each step's change goes into ``W_g``; the next step starts from ``W_g``.

    Args:
        optimizer, model, topology, broadcast, stall: see :class:`~hsgd._engine.mode.SyncMode`;
            it has no settings of its own.

    Every step the inner optimizer updates ``W_x``; the change is accumulated into ``W_g``,
    and the worker continues from a fresh read of ``W_g``. Any torch optimizer works; its
    state (momentum, Adam moments) stays local.
    """

    @dataclass(frozen=True)
    class Settings(BoxMode.Settings):
        """:class:`AsyncSGD`'s settings: none."""

    settings: Settings
    name = "async"
    _change: Optional[torch.Tensor] = None

    def _step(self) -> None:
        self._binding.gather()
        if self._change is None:
            self._change = torch.empty_like(self.local)
        before = self._change.copy_(self.local)
        self._unscale_local()
        self._optimizer_step()
        with self._phase():
            self._binding.gather()
            self.box.accumulate(0, before.neg_().add_(self.local))  # the step's change, in place
            self.box.read(0, self.local)
            self._binding.scatter()

    def _close(self) -> None:
        self.topology.comm.Barrier()  # every rank's last change is in W_g before anyone frees it
        super()._close()
