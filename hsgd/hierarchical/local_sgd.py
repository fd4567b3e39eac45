"""``HierarchicalLocalSGD``: local steps, parameters averaged in the node, then globally;
and ``HierarchicalDiLoCo``: the global round as DiLoCo's outer step.

Hierarchical local SGD (Lin et al., ICLR 2020, https://arxiv.org/abs/1808.07217):
every rank steps on its own gradients; the parameters are then averaged within the
node when ``t % intra_period == 0`` and over all ranks when
``t % (intra_period * inter_period) == 0``, where ``t`` counts the steps taken before
this one (torch's ``HierarchicalModelAverager``'s semantics). Periods of 1 equal
synchronous SGD for plain SGD without momentum. With ``outer_optimizer`` the global
round is DiLoCo's (:mod:`hsgd.hierarchical.outer`); ``lambda p: torch.optim.SGD(p,
lr=1.0)`` gives plain hierarchical local SGD again.

The parameters *are* views into this rank's slot of the shared window. Between global
averagings the ranks' models differ: evaluate and save their average
(``hsgd.replicas.averaged_state_dict``), as the trainer does.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .._core.settings import Boolean, Integer, Names, Real, setting
from ..compression import OUTER_COMPRESSIONS, Codec, CodecChoice, Int8, OuterCompression, codec_of
from ..errors import InputTypeError, InputValueError
from .engine import HierarchicalEngine, HierarchicalMode
from .outer import OuterFactory

__all__ = ["HierarchicalLocalSGD", "HierarchicalDiLoCo"]


def _outer_factory(name: str, value: Any) -> None:
    if value is not None and not callable(value):
        raise InputTypeError(f"{name} must be a callable params -> torch.optim.Optimizer, got "
                             f"{type(value).__name__}; e.g. lambda p: "
                             "torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True)")


class HierarchicalLocalSGD(HierarchicalMode):
    """Wraps ``optimizer``: local steps, with periodic two-level parameter averaging.

    Args:
        optimizer, model, topology, broadcast, stall: see :class:`~hsgd._engine.mode.SyncMode`.
        **settings: the fields of :class:`HierarchicalLocalSGD.Settings` (``inter_node``,
            ``compression``, ``intra_period``, ``inter_period``, ``outer_optimizer``,
            ``fragments``, ``fragment_sync_delay``, ``fragment_update_alpha``).

    With ``outer_optimizer`` the pseudo-gradient ``θ_g − mean θ`` is averaged with the two
    levels (and compressed across nodes), the outer optimizer steps the global parameters
    ``θ_g`` with it, and every rank continues from ``θ_g``; the node level every
    ``intra_period`` steps stays a plain average.

    Example::

        >>> opt = HierarchicalLocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model,
        ...                            intra_period=4, inter_period=8)
        >>> for x, y in loader:
        ...     opt.zero_grad()
        ...     loss_fn(model(x), y).backward()
        ...     opt.step()        # local step; averages on steps 0, 4, 8, ... (node) and 0, 32, ... (all)
        >>> opt.close()
    """

    @dataclass(frozen=True)
    class Settings(HierarchicalMode.Settings):
        """:class:`HierarchicalLocalSGD`'s settings; ``fragments``, ``fragment_sync_delay`` and
        ``fragment_update_alpha`` need an outer step (``outer_optimizer``)."""

        flags_off: ClassVar[Tuple[str, ...]] = ("fragments", "fragment_sync_delay", "fragment_update_alpha",
                                                "outer_compression")

        intra_period: int = setting(1, "parameter averaging inside a node every N steps", Integer())
        inter_period: int = setting(1, "... and across nodes every intra_period * N steps", Integer())
        outer_optimizer: Optional[OuterFactory] = setting(
            None, "None (plain averaging), or factory(params) returning a torch.optim.Optimizer that steps the "
                  "global parameters with the averaged pseudo-gradient at each global round (DiLoCo's: "
                  "lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True)); called once per fragment",
            _outer_factory, flag=None)
        fragments: int = setting(1, "streaming DiLoCo: sync the model in N fragments at staggered steps (of about "
                                    "equal size; at most the model's trainable parameter tensors)", Integer())
        fragment_sync_delay: int = setting(0, "merge a fragment N steps after its sync started, its inter-node "
                                              "sums running meanwhile (< intra_period * inter_period)", Integer(0))
        fragment_update_alpha: float = setting(
            0.0, "a merged fragment is ALPHA * local + (1 - ALPHA) * global",
            Real(0, 1, hint="(0: take the global fragment, 1: keep the local one)"))

        outer_compression: Union[OuterCompression, Codec] = setting(
            "none", "none | fp16 | bf16 | int8 | int4, or a hsgd.compression codec of these: how DiLoCo's "
                    "pseudo-gradients cross nodes (int8, int4: 8 or 4 bits and a scale per 256 values, with error "
                    "feedback across outer rounds); the node average stays exact (docs/diloco.md)",
            CodecChoice(OUTER_COMPRESSIONS, also=(None,)))

        def outer_step(self) -> bool:
            """Whether the global round is an outer step (DiLoCo's)."""
            return self.outer_optimizer is not None

        def outer_codec(self) -> Optional[Codec]:
            """The codec of the pseudo-gradients across nodes (``None``: exact sums). By name,
            int8's and int4's blocks run on across tensors (``Int8(tensor_blocks=False)``): the
            pseudo-gradient is one vector of the whole model, no block padded."""
            codec = codec_of(self.outer_compression)
            if isinstance(self.outer_compression, str) and isinstance(codec, Int8):
                codec = dataclasses.replace(codec, tensor_blocks=False)
            return codec

        def _check_together(self, names: Names) -> None:
            super()._check_together(names)
            outer = self.outer_codec()
            if self.outer_step() and self.codec() is not None:
                name = self.compression if self.compression in OUTER_COMPRESSIONS else "int8"
                raise InputValueError(f"with DiLoCo's outer step only the pseudo-gradients cross nodes: pass "
                                      f"{names.given('outer_compression', name)} instead of "
                                      f"{names.given('compression', self.compression)}")
            if outer is not None and not self.outer_step():
                raise InputValueError(f"{names('outer_compression')} compresses DiLoCo's pseudo-gradients: pass "
                                      f"{names('outer_optimizer')} too (or use HierarchicalDiLoCo), or "
                                      f"{names('compression')} for plain local SGD's averages")
            if outer is not None and outer.whole_tensors:
                raise InputValueError(f"{names('outer_compression')} takes {', '.join(OUTER_COMPRESSIONS)} or their "
                                      f"codecs (Half, Int8, Int4), not {outer.name}")
            codec = self.codec()
            if codec is not None and codec.feedback:
                raise InputValueError(f"{names.given('compression', self.compression)} keeps error feedback, for "
                                      f"sums of gradients; local SGD averages parameters: use "
                                      f"{names.given('compression', 'fp16')} or bf16 with it, DiLoCo's "
                                      f"{names('outer_compression')} (its pseudo-gradients), or this compression "
                                      f"with synchronous SGD (HierarchicalSGD, --sync sync)")
            if not self.outer_step() and (self.fragments != 1 or self.fragment_sync_delay
                                          or self.fragment_update_alpha):
                raise InputValueError(f"{names('fragments')}, {names('fragment_sync_delay')} and "
                                      f"{names('fragment_update_alpha')} belong to DiLoCo's outer step: pass "
                                      f"{names('outer_optimizer')} too (or use HierarchicalDiLoCo)")
            period = self.intra_period * self.inter_period
            if self.fragment_sync_delay >= period:
                raise InputValueError(
                    f"{names.given('fragment_sync_delay', self.fragment_sync_delay)} must be below the global "
                    f"period {names('intra_period')} * {names('inter_period')} = {period}: a fragment merges "
                    "before it syncs again")

    settings: Settings
    name = "local"
    bind = "data"
    replicas_differ = True
    balances = True

    def _outer_factory(self) -> Optional[OuterFactory]:
        return self.settings.outer_optimizer

    def _make_engine(self, params: List[torch.nn.Parameter]) -> HierarchicalEngine:
        with contextlib.ExitStack() as undo:  # if the outer step fails to start: free the engine
            engine = super()._make_engine(params)
            undo.callback(engine.close)
            factory, settings = self._outer_factory(), self.settings
            if factory is not None:
                engine.start_outer(factory, settings.intra_period * settings.inter_period, settings.fragments,
                                   settings.fragment_sync_delay, float(settings.fragment_update_alpha),
                                   settings.outer_codec())
            undo.pop_all()
        return engine

    def averaging_level(self, step: int) -> Optional[str]:
        """``"global"``, ``"node"`` or ``None``: what step ``step`` averages."""
        if step % (self.settings.intra_period * self.settings.inter_period) == 0:
            return "global"
        if step % self.settings.intra_period == 0:
            return "node"
        return None

    def _step(self) -> None:
        self._unscale_local()
        self._optimizer_step()
        step, outer = self.num_steps, self.engine.outer
        level = self.averaging_level(step)
        if outer is not None and level == "global":  # the outer step is the global round
            level = None if outer.overwrites(step) else "node"
        if level is not None:
            # batch_shares: rank r's parameters count in proportion to its batch
            self.engine.average_bound(level, self._shares.factor(level))
        if outer is not None:
            outer.step(step, self._shares.factor("global"))

    def state_dict(self) -> Dict[str, Any]:
        """The inner optimizer's state and step count; with ``outer_optimizer`` also
        ``"hsgd_outer"``: the global parameters, the outer optimizers' state and this rank's
        pseudo-gradients in flight; with an ``outer_compression`` that keeps error feedback,
        ``"hsgd_outer_codec"``: this rank's part of it (in :meth:`rank_state_dict`)."""
        state = super().state_dict()
        if self.engine.outer is not None:
            state["hsgd_outer"] = self.engine.outer.state_dict()
        return state

    def rank_state_dict(self) -> Optional[Dict[str, Any]]:
        """:class:`~hsgd.hierarchical.engine.HierarchicalMode`'s, and ``"hsgd_outer_codec"``: the
        error feedback of the pseudo-gradients that this rank keeps for its node (with an
        ``outer_compression`` that keeps one)."""
        state = super().rank_state_dict()
        outer = self.engine.outer
        if outer is None or not outer.window.feedback:
            return state
        return {**(state or {}), "hsgd_outer_codec": outer.window.state_dict()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned: the inner optimizer's state and step count and,
        with ``outer_optimizer``, the outer step's (``"hsgd_outer"``). Raises
        :class:`~hsgd.errors.InputValueError` if the state is from a run with an outer optimizer
        and this one has none, or the other way round."""
        state_dict = dict(state_dict)
        outer = state_dict.pop("hsgd_outer", None)
        outer_codec = state_dict.pop("hsgd_outer_codec", None)
        engine_outer = self.engine.outer
        if (outer is None) != (engine_outer is None):
            raise InputValueError("the optimizer state is from a run " + ("without" if outer is None else "with")
                                  + " an outer optimizer (DiLoCo); resume with the same mode")
        super().load_state_dict(state_dict)
        if outer is not None and engine_outer is not None:
            engine_outer.load_state_dict(outer)
            if engine_outer.window.feedback:  # after the sums in flight were drained
                self._load_codec(engine_outer.window, outer_codec, "of the pseudo-gradients ")

    def merge_state_dicts(self, states: Sequence[Dict[str, Any]], world_size: int) -> Dict[str, Any]:
        """The mean of the old ranks' states (the inner optimizers' too); ``θ_g`` and the outer
        state are the same on every rank. A streaming fragment in flight is sent again by every
        new rank with the mean of the old ranks' contributions, so its sum over the new ranks,
        divided by their number, is the old ranks' mean: the merge it was to make."""
        # the error feedback belongs to a node of the old layout: it starts afresh (said at the load)
        states = [{k: v for k, v in state.items() if k not in ("hsgd_codec", "hsgd_outer_codec")} for state in states]
        merged = super().merge_state_dicts(states, world_size)
        if "hsgd_outer" in merged:
            merged["hsgd_outer"]["world_size"] = world_size
        return merged


class HierarchicalDiLoCo(HierarchicalLocalSGD):
    """:class:`HierarchicalLocalSGD` with DiLoCo's outer step: SGD on the global parameters
    with learning rate ``outer_lr``, momentum ``outer_momentum`` and Nesterov
    (``outer_nesterov``); the defaults are DiLoCo's (0.7, 0.9, Nesterov). Its settings are
    :class:`HierarchicalDiLoCo.Settings`; the other arguments are :class:`HierarchicalLocalSGD`'s.

    Example::

        >>> opt = HierarchicalDiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-3), model,
        ...                          intra_period=10, inter_period=50)  # outer SGD, lr 0.7, Nesterov 0.9
    """

    @dataclass(frozen=True)
    class Settings(HierarchicalLocalSGD.Settings):
        """:class:`HierarchicalDiLoCo`'s settings: :class:`HierarchicalLocalSGD`'s (but
        ``outer_optimizer``: the outer step is SGD with these) and the outer SGD's."""

        flags_off: ClassVar[Tuple[str, ...]] = ()

        outer_lr: float = setting(0.7, "DiLoCo's outer learning rate", Real(0, open_low=True, hint="(DiLoCo: 0.7)"))
        outer_momentum: float = setting(0.9, "DiLoCo's outer momentum in [0, 1)",
                                        Real(0, 1, open_high=True, hint="(DiLoCo: 0.9)"))
        outer_nesterov: bool = setting(True, "Nesterov outer momentum", Boolean())

        def outer_step(self) -> bool:
            return True

        def _check_together(self, names: Names) -> None:
            if self.outer_optimizer is not None:
                raise InputTypeError("HierarchicalDiLoCo builds its outer SGD from outer_lr, outer_momentum and "
                                     "outer_nesterov; for another outer optimizer use "
                                     "HierarchicalLocalSGD(outer_optimizer=...)")
            if self.outer_nesterov and self.outer_momentum == 0:
                raise InputValueError(f"{names('outer_nesterov')} needs {names('outer_momentum')} > 0; pass "
                                      f"{names.given('outer_nesterov', False)} for plain outer SGD")
            super()._check_together(names)

    settings: Settings
    name = "diloco"

    def _outer_factory(self) -> Optional[OuterFactory]:
        return self._outer_sgd

    def _outer_sgd(self, params: List[torch.nn.Parameter]) -> torch.optim.Optimizer:
        settings = self.settings
        return torch.optim.SGD(params, lr=settings.outer_lr, momentum=settings.outer_momentum,
                               nesterov=settings.outer_nesterov)
