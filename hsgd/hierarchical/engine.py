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
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Union

import torch

from .._core.agree import collective_error
from .._core.meter import Meter
from .._core.settings import Boolean, Choice, Integer, Names, setting
from .._engine.binding import SlotBinding
from .._engine.mode import SyncMode
from .._engine.protocols import Engine
from ..compression import COMPRESSIONS, DEFAULT_POWERSGD_RANK, Codec, CodecChoice, Compression, codec_of
from ..errors import InputTypeError, InputValueError
from ..inter_node import STRATEGIES, InterNode
from ..intra_node import Layout
from ..topology import Topology
from .averager import HierarchicalAverager
from .outer import OuterFactory, OuterLoop
from .overlap import BackwardOverlap

__all__ = ["HierarchicalEngine", "HierarchicalMode"]


def _layout(params, bind: str) -> Layout:
    """One segment entry per parameter, plus the used-flags when gradients are bound (summed
    exactly whatever the compression: a flag must stay 0 where no rank used the parameter)."""
    specs = [(p.dtype, p.numel()) for p in params]
    shapes = [p.shape for p in params]
    if bind == "grad":
        specs.append((torch.float32, len(params)))
        shapes.append(torch.Size([len(params)]))
    try:
        return Layout(specs, shapes, exact=[len(params)] if bind == "grad" else [])
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
                 compression: Optional[Codec], zero_copy: bool = True, meter: Optional[Meter] = None) -> None:
        self.overlap: Optional[BackwardOverlap] = None
        self.outer: Optional[OuterLoop] = None
        self._params = params
        super().__init__(topology, _layout(params, bind), inter_node, compression, meter)
        with contextlib.ExitStack() as undo:  # if the binding fails: free the window
            undo.callback(super()._close)
            self.binding = SlotBinding(self, params, bind, flags=bind == "grad", zero_copy=zero_copy)
            undo.pop_all()

    def start_overlap(self, **kwargs: Any) -> None:
        """Average the bound gradients in buckets during backward (:class:`BackwardOverlap`'s
        arguments but the averager and the binding). Collective."""
        self.overlap = BackwardOverlap(self, self.binding, **kwargs)

    def start_outer(self, factory: OuterFactory, period: int, fragments: int, delay: int, alpha: float,
                    compression: Optional[Codec] = None) -> None:
        """DiLoCo's outer step over the bound parameters (:class:`OuterLoop`'s arguments), in a
        second window of the same layout and inter-node strategy, its pseudo-gradients summed
        across nodes through ``compression``. Collective."""
        self.outer = OuterLoop(self.topology, self.layout, self.inter_node, compression, self._params, factory,
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
        codec = self.inter.codec
        return f"inter_node={self.inter_node!r}" + ("" if codec is None else f", compression={codec!r}")

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
        compression: Union[Compression, Codec] = setting(
            "none", "none | fp16 | bf16 | int8 | powersgd, or a hsgd.compression codec: how the node sums cross "
                    "nodes (fp16/bf16: 16 bits, half the bytes; int8: 8 bits and a scale per 256 values, with "
                    "error feedback; powersgd: low-rank factors of each matrix, with error feedback, "
                    "inter_node leader only); nothing changes inside a node (docs/compression.md)",
            CodecChoice(COMPRESSIONS, also=(None,)))
        powersgd_rank: int = setting(DEFAULT_POWERSGD_RANK, "compression powersgd: the rank of its factors "
                                                            "(a matrix n x m sends (n + m) * rank values)", Integer())
        zero_copy: bool = setting(
            True, "bind CPU gradients (or parameters) as views into this rank's slot of the shared window; "
                  "False stages them, copied into the slot before an average and out of it after, as tensors "
                  "on a GPU always are: the GPU path, run on the CPU (the same results, a copy each way)",
            Boolean(), flag=None)

        def codec(self) -> Optional[Codec]:
            """The codec ``compression`` names or is (``None``: exact sums)."""
            return codec_of(self.compression, self.powersgd_rank)

        def _check_together(self, names: Names) -> None:
            if self.powersgd_rank != DEFAULT_POWERSGD_RANK and self.compression != "powersgd":
                powersgd = names.given("compression", "powersgd")
                raise InputValueError(f"{names('powersgd_rank')} sets the rank of {powersgd} (a PowerSGD codec "
                                      f"object carries its own rank); drop it, or pass {powersgd}")
            codec = self.codec()
            if codec is not None and codec.whole_tensors and self.inter_node == "sharded":
                raise InputValueError(f"{names.given('compression', self.compression)} compresses whole matrices, "
                                      f"which {names.given('inter_node', 'sharded')} cuts into element-even "
                                      f"slices; use {names.given('inter_node', 'leader')}")

    settings: Settings
    bind: ClassVar[str] = "grad"
    engine: HierarchicalEngine

    def _make_engine(self, params: List[torch.nn.Parameter]) -> HierarchicalEngine:
        return HierarchicalEngine(self.topology, params, self.bind, self.settings.inter_node, self.settings.codec(),
                                  self.settings.zero_copy, self.meter)

    # --- the codec's error feedback: this rank's own, saved and loaded with the optimizer's state
    def state_dict(self) -> Dict[str, Any]:
        """The inner optimizer's state and step count and, with a codec that keeps error feedback
        (``int8``, ``powersgd``), ``"hsgd_codec"``: this rank's part of it (:meth:`rank_state_dict`)."""
        state = super().state_dict()
        state.update(self.rank_state_dict() or {})
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned. Collective with a codec that keeps error feedback:
        a ``"hsgd_codec"`` saved by this rank of a job of the same ranks, nodes and settings is
        loaded, else the error feedback starts afresh on every rank (with a warning)."""
        state_dict = dict(state_dict)
        codec = state_dict.pop("hsgd_codec", None)
        super().load_state_dict(state_dict)
        if self.engine.feedback:
            self._load_codec(self.engine, codec)

    def _load_codec(self, averager: HierarchicalAverager, state: Optional[Dict[str, Any]], what: str = "") -> None:
        """Load ``averager``'s error feedback from ``state`` (collective), or start it afresh with a warning."""
        if not averager.load_state_dict(state) and self.topology.rank == 0:
            warnings.warn(f"the compression's error feedback {what}in this state was saved by another job (ranks, "
                          "nodes, inter_node or compression) or is missing: it starts afresh", RuntimeWarning,
                          stacklevel=3)

    def rank_state_dict(self) -> Optional[Dict[str, Any]]:
        """The part of :meth:`state_dict` that differs between ranks although the replicas do not:
        ``{"hsgd_codec": ...}``, the error feedback that this rank keeps for its node; ``None``
        without a codec that keeps one. Save it per rank (the trainer's checkpoint gathers it)."""
        codec = self.engine.state_dict()
        return None if codec is None else {"hsgd_codec": codec}

    @property
    def averager(self) -> HierarchicalAverager:
        """The averager of the mode's tensors (its engine, which extends
        :class:`~hsgd.hierarchical.averager.HierarchicalAverager`)."""
        return self.engine
