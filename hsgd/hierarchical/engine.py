"""The hierarchical family's engine, and the base of its modes.

:class:`HierarchicalEngine` is the family's one object below the mode: a
two-level averager (:class:`~hsgd.hierarchical.averager.HierarchicalAverager`,
which it extends) with the trained gradients (``bind="grad"``) or parameters (``"data"``) bound to this rank's
slot (:class:`~hsgd._engine.binding.SlotBinding`) and, for
``HierarchicalSGD(overlap=True)``, the averaging of gradient buckets during
backward (``hsgd.hierarchical.overlap.BackwardOverlap``) or, for
``HierarchicalLocalSGD(outer_optimizer=...)``, DiLoCo's outer step
(:class:`~hsgd.hierarchical.outer.OuterLoop`).

:class:`HierarchicalMode` is what :class:`~hsgd.HierarchicalSGD` and
:class:`~hsgd.HierarchicalLocalSGD` share: the inter-node strategy and the
compression of its sums, settings of every hierarchical mode.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ClassVar, List, Optional

import torch

from .._core.agree import collective_error
from .._core.meter import Meter
from .._core.settings import Boolean, Choice, setting
from .._engine.binding import SlotBinding
from .._engine.mode import SyncMode
from .._engine.protocols import Engine
from ..compression import COMPRESSIONS, Compression
from ..errors import InputTypeError
from ..inter_node import STRATEGIES, InterNode
from ..intra_node import Layout
from ..topology import Topology
from .averager import HierarchicalAverager
from .outer import OuterFactory, OuterLoop
from .overlap import BackwardOverlap

__all__ = ["HierarchicalEngine", "HierarchicalMode"]


def _layout(params, bind: str) -> Layout:
    """One segment entry per parameter, plus the used-flags when gradients are bound."""
    specs = [(p.dtype, p.numel()) for p in params]
    if bind == "grad":
        specs.append((torch.float32, len(params)))
    try:
        return Layout(specs)
    except InputTypeError as exc:  # same dtypes on every rank, so the same error
        raise collective_error(InputTypeError, str(exc)) from None


class HierarchicalEngine(HierarchicalAverager, Engine):
    """The averager of a hierarchical mode: a :class:`HierarchicalAverager` whose slot holds the
    mode's tensors. Collective to build.

    The trained gradients (``bind="grad"``, with the used-flags) or parameters (``"data"``)
    are bound to this rank's slot; :meth:`average_bound` averages them, and the averager's own
    methods (:meth:`~HierarchicalAverager.average`, the per-span phases) work on the slot as
    for any averager. One object: the mode's ``engine`` and ``averager`` are this.

    ``meter``: the mode's :class:`~hsgd._core.meter.Meter`, which both levels and the outer
    step count their bytes in and report their phases to.

    Attributes:
        binding: the :class:`~hsgd._engine.binding.SlotBinding` of ``params``.
        overlap: the ``hsgd.hierarchical.overlap.BackwardOverlap``, or ``None``.
        outer: the :class:`~hsgd.hierarchical.outer.OuterLoop`, or ``None``.
    """

    def __init__(self, topology: Topology, params: List[torch.nn.Parameter], bind: str, inter_node: str,
                 compression: Optional[str], zero_copy: bool = True, meter: Optional[Meter] = None) -> None:
        self.overlap: Optional[BackwardOverlap] = None
        self.outer: Optional[OuterLoop] = None
        self._args = (params, compression)
        super().__init__(topology, _layout(params, bind), inter_node, compression, meter)
        with contextlib.ExitStack() as undo:  # if the binding fails: free the window
            undo.callback(super()._close)
            self.binding = SlotBinding(self, params, bind, flags=bind == "grad", zero_copy=zero_copy)
            undo.pop_all()

    def start_overlap(self, **kwargs: Any) -> None:
        """Average the bound gradients in buckets during backward (:class:`BackwardOverlap`'s
        arguments but the averager and the binding). Collective."""
        self.overlap = BackwardOverlap(self, self.binding, **kwargs)

    def start_outer(self, factory: OuterFactory, period: int, fragments: int, delay: int, alpha: float) -> None:
        """DiLoCo's outer step over the bound parameters (:class:`OuterLoop`'s arguments), in a
        second window of the same layout and inter-node strategy. Collective."""
        params, compression = self._args
        self.outer = OuterLoop(self.topology, self.layout, self.inter_node, compression, params, factory,
                               period, fragments, delay, alpha, meter=self.meter)

    def average_bound(self, level: str, weight: float, passes: int = 1) -> None:
        """Replace every rank's bound tensors by their mean over ``level``, each rank's weighted by
        ``weight`` and the result divided by ``passes``."""
        self.binding.gather()
        if weight != 1.0:
            self.binding.scale_(weight)
        self.average(level, 1.0 / passes)
        self.binding.scatter()

    def describe(self) -> str:
        compression = self.inter.compression
        return f"inter_node={self.inter_node!r}" + ("" if compression == "none" else f", compression={compression!r}")

    def _close(self) -> None:
        if self.outer is not None:
            self.outer.close()
            self.outer = None
        if self.overlap is not None:
            self.overlap.close()
            self.overlap = None
        self.binding.unbind()
        super()._close()


class HierarchicalMode(SyncMode):
    """The base of the hierarchical modes: ``inter_node``, ``compression`` and ``zero_copy`` (its
    :attr:`Settings`, which each hierarchical mode's extend) besides the mode's own settings
    (see :class:`~hsgd._engine.mode.SyncMode` for the other arguments)."""

    @dataclass(frozen=True)
    class Settings(SyncMode.Settings):
        """The settings every hierarchical mode has: how the inter-node sums run."""

        inter_node: InterNode = setting("leader", "leader | sharded inter-node allreduce (hsgd.inter_node)",
                                        Choice(STRATEGIES))
        compression: Compression = setting(
            "none", "none | fp16 | bf16: the inter-node sums cross nodes in 16 bits, halving inter-node bytes; "
                    "nothing changes inside a node", Choice(COMPRESSIONS, also=(None,)))
        zero_copy: bool = setting(
            True, "bind CPU gradients (or parameters) as views into this rank's slot of the shared window; "
                  "False stages them, copied into the slot before an average and out of it after, as tensors "
                  "on a GPU always are: the GPU path, run on the CPU (the same results, a copy each way)",
            Boolean(), flag=None)

    settings: Settings
    bind: ClassVar[str] = "grad"
    engine: HierarchicalEngine

    def _make_engine(self, params: List[torch.nn.Parameter]) -> HierarchicalEngine:
        compression = self.settings.compression
        return HierarchicalEngine(self.topology, params, self.bind, self.settings.inter_node,
                                  None if compression == "none" else compression, self.settings.zero_copy,
                                  self.meter)

    @property
    def averager(self) -> HierarchicalAverager:
        """The averager of the mode's tensors (its engine, which extends
        :class:`~hsgd.hierarchical.averager.HierarchicalAverager`)."""
        return self.engine
