"""DiLoCo's outer step for hierarchical local SGD, whole or in streaming fragments.

DiLoCo (Douillard et al. 2023, https://arxiv.org/abs/2311.08105) keeps, on every rank,
the last global parameters ``θ_g``. At a global round the change of the ranks' mean
model over the round is a *pseudo-gradient*::

    Δ = θ_g − mean over ranks of θ           (averaged with the two levels)
    θ_g := outer_optimizer.step(θ_g, grad=Δ)  (e.g. SGD, lr 0.7, Nesterov momentum 0.9)
    θ   := θ_g                                 (every rank continues from θ_g)

Streaming DiLoCo (Douillard et al. 2025, https://arxiv.org/abs/2501.18512): fragments
that sync at staggered steps (:class:`OuterLoop`). Every rank runs the same schedule,
so the node's fences and the level-2 sums meet. A checkpoint holds ``θ_g``, the outer
optimizers' state and a fragment in flight's own part (sent again on resume, through the
codec's error feedback as it was before that round: the resumed sum is the unstopped one).
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch

from .._core.agree import check_all, collective_error
from .._core.closable import Closable
from .._core.meter import Meter
from .._engine.binding import slot_views
from ..compression import Codec
from ..errors import InputTypeError, InputValueError
from .averager import HierarchicalAverager

__all__ = ["OuterLoop", "OuterFactory", "fragment_groups"]

Span = Tuple[int, int, int]  # (segment, lo, hi) in the window
#: ``factory(params) -> torch.optim.Optimizer``: builds an outer optimizer over a fragment's global parameters.
OuterFactory = Callable[[List[torch.nn.Parameter]], torch.optim.Optimizer]


def fragment_groups(numels: Sequence[int], fragments: int) -> List[Tuple[int, int]]:
    """``fragments`` ranges ``[a, b)`` of consecutive parameters, of about equal total size
    (each at least one parameter): the ``k``-th cut falls at the parameter boundary nearest to
    ``k/F`` of the whole."""
    n, total = len(numels), sum(numels)
    cuts, running = [0], 0
    for i in range(n - 1):  # a cut after parameter i
        running += numels[i]
        k, left = len(cuts), n - (i + 1)  # the fragment a cut here would start; parameters after i
        nearest = (2 * running + numels[i + 1]) * fragments >= 2 * k * total  # past the midpoint to the target
        if k < fragments and left >= fragments - k and (nearest or left == fragments - k):
            cuts.append(i + 1)
    cuts.append(n)
    return list(zip(cuts[:-1], cuts[1:]))


class OuterLoop(Closable):
    """The outer optimizer(s), ``θ_g`` and the pseudo-gradient window of one mode. Collective.

    Args:
        topology, layout, inter_node: the second window's, as the parameters'.
        compression: the codec of the pseudo-gradients' sums across nodes (``None``: exact).
        params: the trained parameters (their values are the replica ``θ``).
        factory: ``factory(params) -> torch.optim.Optimizer`` over ``θ_g``'s tensors; called
            once per fragment.
        period: steps between two syncs of a fragment (``intra_period * inter_period``).
        fragments, delay, alpha: ``F``, ``τ`` and ``α`` below.
        meter: the mode's :class:`~hsgd._core.meter.Meter`, which counts these bytes and hears of
            these phases too.

    Streaming: the parameters are split into ``F`` fragments of about equal size; fragment
    ``f`` syncs at steps ``t`` with ``(t − offset_f) % period == 0``, ``offset_f = f·period
    // F``, so a step sends at most one fragment's bytes. Its inter-node sums run in the
    background while the inner steps go on, and are merged ``τ`` (``delay``) steps later,
    mixed with the local weights by ``α``: ``θ_f := α·θ_f + (1 − α)·θ_g,f``. As in
    torchft's ``StreamingDiLoCo``, the pseudo-gradient is taken when the sync starts.

    The pseudo-gradients live in a second shared window (a
    :class:`~hsgd.hierarchical.averager.HierarchicalAverager` of its own), so the
    parameters, views into the first one, are never overwritten by a sum in flight. A
    fragment's sync is a node reduce to the node's first slot, the level-2 sum of that span
    started without waiting (moved on at every step), and at its merge step the wait and
    the spread back. ``compression`` (``outer_compression``) applies to those level-2 sums
    of ``Δ``; a codec's error feedback (int8, int4) is kept per fragment, settled at its
    merge, and carried to the fragment's next round.
    """

    def __init__(self, topology, layout, inter_node: str, compression: Optional[Codec],
                 params: List[torch.nn.Parameter], factory: OuterFactory, period: int, fragments: int = 1,
                 delay: int = 0, alpha: float = 0.0, meter: Optional[Meter] = None):
        if fragments > len(params):
            raise collective_error(InputValueError, f"fragments={fragments} but the model has "
                                   f"{len(params)} trainable parameter tensors; use fragments <= {len(params)}")
        self.topology, self.params = topology, params
        self.period, self.fragments, self.delay, self.alpha = period, fragments, delay, alpha
        self.anchor = [torch.nn.Parameter(p.detach().clone()) for p in params]  # θ_g
        self.groups = fragment_groups([p.numel() for p in params], fragments)
        self.outers = check_all(topology.comm, _build_outers, factory, self.anchor, self.groups)
        _check_same_outers(self.outers, topology.comm)
        self.offsets = [f * period // fragments for f in range(fragments)]
        self.spans = [_spans(layout, params, a, b) for a, b in self.groups]
        self.window = HierarchicalAverager(topology, layout, inter_node, compression, meter)
        self.meter = self.window.meter
        self.views = slot_views(self.window, params)
        # fragment -> (start step, [its queued sum or None per span], this rank's contribution or None)
        self.in_flight: Dict[int, Tuple[int, list, Optional[List[torch.Tensor]]]] = {}
        self._resend: Dict[int, Tuple[int, List[torch.Tensor]]] = {}
        self._sums = _Queue()
        self._opened()

    # --- the schedule --------------------------------------------------------------------------
    def starts(self, fragment: int, step: int) -> bool:
        """Whether ``fragment``'s sync starts after step ``step`` (0, 1, ...)."""
        since = step - self.offsets[fragment]
        return since >= 0 and since % self.period == 0

    def overwrites(self, step: int) -> bool:
        """Whether the outer step after ``step`` sets every parameter to ``θ_g`` (one fragment,
        merged at once, ``α = 0``): a plain average of the parameters then would be lost."""
        return self.fragments == 1 and self.delay == 0 and self.alpha == 0 and self.starts(0, step)

    def step(self, step: int, weight: float = 1.0) -> None:
        """After inner step ``step``: resend what a checkpoint had in flight, move the sums on,
        merge the fragments due, start those whose turn it is. ``weight``: this rank's factor
        in the global mean (batch shares). Collective."""
        for f, (start, contribution) in sorted(self._resend.items()):
            self._send(f, start, contribution)
        self._resend.clear()
        self._sums.test()
        for f in sorted(f for f, (start, _, _) in self.in_flight.items() if start + self.delay == step):
            self._merge(f)
        for f in range(self.fragments):
            if self.starts(f, step):
                self._start(f, step, weight)
                if self.delay == 0:
                    self._merge(f)

    def _start(self, f: int, step: int, weight: float) -> None:
        a, b = self.groups[f]
        with torch.no_grad():
            for i in range(a, b):  # this rank's Δ_f, weighted
                view = self.views[i]
                view.copy_(self.anchor[i].detach() - self.params[i].detach())
                if weight != 1.0:
                    view.mul_(weight)
            kept = [self.views[i].clone() for i in range(a, b)] if self.delay else None
        self._send(f, step, kept)

    def _send(self, f: int, start: int, contribution: Optional[List[torch.Tensor]]) -> None:
        if contribution is not None:
            a, _ = self.groups[f]
            with torch.no_grad():
                for i, value in enumerate(contribution):
                    self.views[a + i].copy_(value)
        self.in_flight[f] = (start, [self._begin(span) for span in self.spans[f]], contribution)

    def _begin(self, span: Span):
        window = self.window
        if self.topology.num_nodes == 1:
            with self.meter.phase("intra"):
                self._fenced(window.node_mean_of, span, 1.0)
            return None
        with self.meter.phase("intra"):
            self._fenced(window.reduce_of, span)
        return self._sums.push(lambda: window.start_across(span))

    def _end(self, span: Span, queued) -> None:
        if queued is None:
            return
        self._sums.wait(queued)
        with self.meter.phase("intra"):
            self._fenced(self.window.spread_of, span, 1.0 / self.topology.size)

    def _fenced(self, fn, *args) -> None:
        self.window.slots.fence()  # every rank of the node has written (or read) the span
        fn(*args)
        self.window.slots.fence()  # ... and the result is in place before anyone goes on

    def _merge(self, f: int) -> None:
        _, pendings, _ = self.in_flight.pop(f)
        for span, pending in zip(self.spans[f], pendings):
            self._end(span, pending)
        # the codec's error feedback of this fragment's sums (kept if its Δ is finite); the other
        # fragments' sums in flight keep theirs pending
        self.window.settle(self.spans[f])
        a, b = self.groups[f]
        with torch.no_grad():
            for i in range(a, b):
                self.anchor[i].grad = self.views[i].to(self.anchor[i].device, copy=True)  # Δ_f
        self.outers[f].step()
        with torch.no_grad():
            for i in range(a, b):
                theta = self.params[i].detach()
                if self.alpha:
                    theta.mul_(self.alpha).add_(self.anchor[i].detach(), alpha=1.0 - self.alpha)
                else:
                    theta.copy_(self.anchor[i].detach())

    # --- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """``θ_g``, each fragment's outer optimizer state, and this rank's contributions in flight."""
        return {"anchor": [t.detach().cpu().clone() for t in self.anchor],
                "outer": [o.state_dict() for o in self.outers],
                "in_flight": {f: (start, [t.clone() for t in kept])
                              for f, (start, _, kept) in self.in_flight.items() if kept is not None},
                "world_size": self.topology.size}

    def load_state_dict(self, state: dict) -> None:
        """The inverse of :meth:`state_dict`; contributions in flight are sent again at the next
        step, if the state is for this rank count (the mode's ``merge_state_dicts`` makes one
        from another rank count's); else dropped. Collective."""
        self._drain()
        with torch.no_grad():
            for t, saved in zip(self.anchor, state["anchor"]):
                t.copy_(saved)
        for o, saved in zip(self.outers, state["outer"]):
            o.load_state_dict(saved)
        same_world = state.get("world_size") == self.topology.size
        self._resend = dict(state.get("in_flight", {})) if same_world else {}

    def _drain(self) -> None:
        """Wait for the sums in flight and drop them (collective)."""
        for f in sorted(self.in_flight):
            _, pendings, _ = self.in_flight[f]
            for span, pending in zip(self.spans[f], pendings):
                self._end(span, pending)
        self.in_flight.clear()

    def _close(self) -> None:
        self._drain()
        self.window.close()


class _Queued:
    """One span's level-2 sum: ``start()`` gives its :class:`~hsgd.inter_node.Pending`."""

    def __init__(self, start: Callable[[], Any]):
        self.start = start
        self.pending: Optional[Any] = None  # its Pending, once started

    @property
    def done(self) -> bool:
        return self.pending is not None and self.pending.done


class _Queue:
    """The level-2 sums in flight, run one after another in the order they were queued. A sum
    starts its next step when its last one completed, which ranks see at different times: two
    sums moved on side by side (two streaming fragments in flight, or a codec's two steps)
    would start MPI's collectives in another order on each rank. One at a time, every rank
    starts them in the queue's order."""

    def __init__(self) -> None:
        self.queue: Deque[_Queued] = collections.deque()  # the first one started

    def push(self, start: Callable[[], Any]) -> _Queued:
        queued = _Queued(start)
        self.queue.append(queued)
        self.test()
        return queued

    def _head(self):
        head = self.queue[0]
        if head.pending is None:
            head.pending = head.start()
        return head.pending

    def test(self) -> None:
        """Move the sums on without waiting."""
        while self.queue and self._head().test():
            self.queue.popleft()

    def wait(self, queued: _Queued) -> None:
        """Wait until ``queued`` is done (and every sum queued before it)."""
        while not queued.done:
            self._head().wait()
            self.queue.popleft()


def _spans(layout, params, a: int, b: int) -> List[Span]:
    """The window spans of parameters ``[a, b)``: one ``(segment, lo, hi)`` per dtype."""
    spans: Dict[int, List[int]] = {}
    for i in range(a, b):
        seg = layout.places[i][0]
        lo, hi = layout.extent(i, params[i].numel())
        if seg in spans:
            spans[seg][0], spans[seg][1] = min(spans[seg][0], lo), max(spans[seg][1], hi)
        else:
            spans[seg] = [lo, hi]
    return [(seg, lo, hi) for seg, (lo, hi) in sorted(spans.items())]


def _build_outers(factory: OuterFactory, anchor, groups) -> List[torch.optim.Optimizer]:
    outers = []
    for a, b in groups:
        try:
            outer = factory(anchor[a:b])
        except (TypeError, ValueError) as exc:
            raise InputValueError(f"outer_optimizer(params) raised {type(exc).__name__}: {exc}; pass a "
                                  "callable params -> torch.optim.Optimizer, e.g. lambda p: "
                                  "torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True)") from None
        if not isinstance(outer, torch.optim.Optimizer):
            raise InputTypeError(f"outer_optimizer(params) returned {type(outer).__name__}, not a "
                                 "torch.optim.Optimizer")
        outers.append(outer)
    return outers


def _check_same_outers(outers, comm) -> None:
    mine = [(type(o).__name__, repr(sorted((k, repr(v)) for k, v in o.defaults.items()))) for o in outers]
    if len(set(map(repr, comm.allgather(mine)))) > 1:
        raise collective_error(InputValueError, "ranks built different outer optimizers (type or "
                               "hyperparameters); pass the same outer_optimizer on every rank")
