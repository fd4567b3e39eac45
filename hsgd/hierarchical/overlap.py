"""Averaging gradients while backward runs: ``HierarchicalSGD(overlap=True)``.

The bound gradients are cut into *buckets* in reverse parameter order, the order
backward produces them (the first small so that averaging starts early, the others
up to ``bucket_cap_mb``, as DDP's). A hook on every parameter counts its backward
passes; a bucket is averaged once every local rank wrote it (:class:`_Pipeline`),
its inter-node sums running in the background while backward goes on. At the end of
the last backward pass the round completes, so ``backward()`` returns with the
averaged gradients, as with DDP. Where it pays: docs/sync.md, docs/benchmarks.md.

Invariants: every element is summed in the same order as without overlap, so inside
a node the averages are the same to the last bit (across nodes MPI may pick another
allreduce algorithm per bucket); level 2's MPI calls happen in bucket order on every
rank, on buckets every rank of the node has written, so waits in backward form no
cycle; a parameter reached late holds back later buckets: overlap lost, not correctness.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import time
from typing import TYPE_CHECKING, Callable, Deque, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from .._core.waits import Backoff
from .._engine.torch_compat import queue_end_of_backward
from .buckets import FIRST_BUCKET_MB, Bucket, plan_buckets

if TYPE_CHECKING:
    from .._engine.protocols import OverlapAverager
    from ..inter_node import Pending

__all__ = ["Bucket", "plan_buckets", "BackwardOverlap", "FIRST_BUCKET_MB"]

POLL_S = 0.001         # how often the poller enters MPI while an inter-node allreduce is under way
_WRITTEN, _REDUCED, _CROSSED = range(3)
_Span = Tuple[int, int, int]  # a bucket's (segment, lo, hi)


class _Stage(NamedTuple):
    waits_for: Optional[Tuple[int, object]]  # (flag, local ranks) every one of which must show this round
    run: Optional[Callable[[_Span], object]]  # fn(span), or None: nothing to do on this rank
    posts: Optional[int]                     # the flag this rank sets after running (or completing)
    start: Optional[Callable[[_Span], Pending]] = None  # fn(span) -> a Pending: work that goes on in the background


class _Pipeline:
    """The board and the per-bucket stages of one averager.

    The ranks of a node meet on a *board* in a second shared window: ``board[r, stage, b]
    == round`` says that local rank ``r`` finished ``stage`` of bucket ``b`` in this round
    (rounds count the averagings, so no flag is ever reset). The stages of a bucket: on one
    node, once every local rank wrote it, each rank averages its slice into every slot;
    ``sharded``, each rank sums its slice into slot 0, allreduces that slice with the ranks
    of its local index on the other nodes and spreads it (no local rank waits for another's
    slice); ``leader``, each rank sums its slice into slot 0 (``REDUCED``), the leader
    allreduces the bucket once every slice is in (``CROSSED``), then each rank spreads its
    slice. The allreduces run one bucket on the wire at a time, in bucket order.

    Memory order: a rank publishes a flag after ``Win.Sync`` of both windows (its stores to
    the slots first), and reads the slots after seeing every flag and another ``Win.Sync``.
    """

    def __init__(self, averager: OverlapAverager, buckets: Sequence[Bucket], scale: float):
        self.averager = averager
        self.buckets = list(buckets)
        topo = averager.topology
        self.me = averager.local_rank
        self.stages = self._stages(averager, topo, scale)
        n = len(self.buckets)
        nbytes = averager.local_size * 3 * n * 8 if self.me == 0 else 0
        with contextlib.ExitStack() as undo:  # if the constructor fails: free the window
            win = MPI.Win.Allocate_shared(nbytes, 8, comm=averager.node_comm)
            self.win: Optional[MPI.Win] = win
            undo.callback(win.Free)
            buf, _ = win.Shared_query(0)
            self.board = np.frombuffer(buf, dtype=np.int64, count=averager.local_size * 3 * n)  # type: ignore[call-overload]  # numpy's stubs take no mpi4py buffer before Python 3.12
            self.board = self.board.reshape(averager.local_size, 3, n)
            win.Lock_all(MPI.MODE_NOCHECK)
            if self.me == 0:
                self.board[...] = 0  # MPI does not zero a window; round 0 is never current
            win.Sync()
            averager.node_comm.Barrier()
            win.Sync()
            undo.pop_all()
        self.round = 1
        self._reset()

    def _reset(self) -> None:
        self._next = [0] * len(self.stages)    # per stage: the next bucket to finish
        self._issued = [0] * len(self.stages)  # per background stage: the next bucket to start
        self._inflight: List[Deque[Pending]] = [collections.deque() for _ in self.stages]  # oldest first

    @property
    def busy(self) -> bool:
        """Whether background work (an inter-node allreduce) is under way."""
        return any(self._inflight)

    def poll(self) -> None:
        """Move the background work on (test it, start the next bucket), running no other
        stage: over TCP a non-blocking allreduce moves only while its rank is inside MPI."""
        n = len(self.buckets)
        for k, stage in enumerate(self.stages):
            if stage.start is not None:
                self._step(k, stage, n if k == 0 else self._next[k - 1])

    @staticmethod
    def _stages(averager: OverlapAverager, topo, scale: float) -> List[_Stage]:
        """What a rank does to each bucket, in order (see the module doc); every part timed as
        its phase (the averager's ``meter``)."""
        meter = averager.meter

        def intra(fn, **kw):
            def run(span: _Span) -> None:
                with meter.phase("intra"):
                    fn(span, **kw)
            return run

        everyone = slice(None)
        if topo.num_nodes == 1:
            return [_Stage((_WRITTEN, everyone), intra(averager.node_mean_of, scale=scale), None)]
        reduce, spread = intra(averager.reduce_of), intra(averager.spread_of, scale=scale / topo.size)
        across = averager.start_across  # in the background: backward and the other buckets go on
        if averager.inter_node == "sharded":  # this rank's slice alone: no local rank waits for another's
            return [_Stage((_WRITTEN, everyone), reduce, None), _Stage(None, None, None, across),
                    _Stage(None, spread, None)]
        leader = averager.local_rank == 0
        return [_Stage((_WRITTEN, everyone), reduce, _REDUCED),
                _Stage((_REDUCED, everyone), None, _CROSSED, across) if leader else _Stage(None, None, None),
                _Stage((_CROSSED, [0]), spread, None)]

    def _memory_barrier(self) -> None:
        """``Win.Sync`` of both windows: the slots' and the board's stores and loads stay ordered."""
        self.averager.sync()
        assert self.win is not None, "the pipeline is closed"
        self.win.Sync()

    def post(self, flag: int, bucket: int) -> None:
        self._memory_barrier()  # this rank's stores to its slot before the flag
        self.board[self.me, flag, bucket] = self.round

    def _ready(self, stage: _Stage, bucket: int) -> bool:
        if stage.waits_for is None:
            return True
        flag, ranks = stage.waits_for
        if not (self.board[ranks, flag, bucket] == self.round).all():
            return False
        self._memory_barrier()  # the other ranks' stores, after their flags
        return True

    def _step(self, k: int, stage: _Stage, limit: int) -> bool:
        """Move stage ``k`` as far as the board allows (buckets below ``limit``); whether it moved.
        A background stage finishes its bucket on the wire once done and starts the next
        one the board allows: one at a time, in bucket order."""
        moved = False
        if stage.start is None:
            while self._next[k] < limit and self._ready(stage, self._next[k]):
                b = self.buckets[self._next[k]]
                if stage.run is not None:
                    stage.run((b.segment, b.lo, b.hi))
                if stage.posts is not None:
                    self.post(stage.posts, self._next[k])
                self._next[k] += 1
                moved = True
            return moved
        queue = self._inflight[k]
        progressed = True
        while progressed:  # one bucket on the wire at a time: the next starts when one completes
            progressed = False
            while queue and queue[0].test():
                queue.popleft()
                if stage.posts is not None:
                    self.post(stage.posts, self._next[k])
                self._next[k] += 1
                moved = progressed = True
            if not queue and self._issued[k] < limit and self._ready(stage, self._issued[k]):
                b = self.buckets[self._issued[k]]
                queue.append(stage.start((b.segment, b.lo, b.hi)))
                self._issued[k] += 1
                moved = progressed = True
        return moved

    def advance(self, block: bool) -> None:
        """Run every stage the board allows, in bucket order; with ``block``, until all are done."""
        n, backoff, waiting_since = len(self.buckets), Backoff(), None
        while self._next[-1] < n:
            moved = False
            for k, stage in enumerate(self.stages):
                moved |= self._step(k, stage, n if k == 0 else self._next[k - 1])
            if moved and waiting_since is not None:  # the wait counts as intra-node time
                self.averager.meter.report("intra", waiting_since, time.perf_counter())
                waiting_since = None
            if not moved:
                if not block:
                    return
                oldest = next((q[0] for q in self._inflight if q), None)
                if oldest is not None:  # nothing else can move: wait for the network in MPI
                    oldest.wait()
                    continue
                waiting_since = waiting_since or time.perf_counter()
                # another local rank is still in backward: give it the core (ranks may share one)
                backoff.idle()
        if waiting_since is not None:
            self.averager.meter.report("intra", waiting_since, time.perf_counter())

    def finish(self) -> None:
        """Drive every bucket to the end, then fence: the round is over on every local rank."""
        self.advance(block=True)
        # Keeps any rank from writing next round's gradients into a slot another rank still reads.
        with self.averager.meter.phase("intra"):
            self.averager.fence()
        self.round += 1
        self._reset()

    def close(self) -> None:
        if self.win is not None:
            self.win.Unlock_all()
            self.win.Free()
            self.win = None


class BackwardOverlap:
    """Hooks that average ``binding``'s gradients bucket by bucket during backward.

    Args:
        averager: the averager of the slot (an :class:`~hsgd._engine.protocols.OverlapAverager`).
        binding: the :class:`~hsgd._engine.binding.SlotBinding` of the gradients (with flags).
        bucket_cap_mb: the size of every bucket but the first.
        passes: backward passes per averaging (``backward_passes_per_step``).
        weight: ``fn()`` -> this rank's factor in the average (batch shares), read per bucket.
        waiting: ``fn(what, count=True)`` -> a context manager around every wait for other
            ranks (the stall inspector's; ``count=False`` for the waits in hooks).

    A round goes ``idle`` -> ``open`` (a hook fired) -> ``done`` (:meth:`complete`: at the
    end of the ``passes``-th backward, or in :meth:`consume` for a rank whose backward
    reached no parameter) -> ``idle`` (:meth:`consume`, :meth:`discard`). Collective to
    build (a shared window) and to :meth:`close`.
    """

    def __init__(self, averager: OverlapAverager, binding, bucket_cap_mb: float, passes: int, weight, waiting):
        self.binding, self.passes, self.weight, self.waiting = binding, passes, weight, waiting
        params = binding.params
        numels = [p.numel() for p in params] + [len(params)]  # the used-flags last
        self.buckets = plan_buckets(averager.layout, numels, bucket_cap_mb * 2 ** 20, tail=1)
        self._of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket.params}
        self.pipeline = _Pipeline(averager, self.buckets, 1.0 / passes)
        self.paused = False
        # Hooks of CUDA parameters run on autograd's device threads, possibly two at once.
        self._lock = threading.RLock()
        self._reset()
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
                       for i, p in enumerate(params)]
        # While an inter-node allreduce is under way and backward computes between hooks, a
        # thread enters MPI every POLL_S to move it (where MPI allows calls from any thread).
        self._wake, self._closing, self._poller = threading.Event(), False, None
        if MPI.Query_thread() == MPI.THREAD_MULTIPLE and averager.topology.num_nodes > 1:
            self._poller = threading.Thread(target=self._poll, name="hsgd-overlap-poll", daemon=True)
            self._poller.start()

    def _poll(self) -> None:
        while self._wake.wait() and not self._closing:
            with self._lock:
                self.pipeline.poll()
                if not self.pipeline.busy:
                    self._wake.clear()
            time.sleep(POLL_S)

    def _reset(self) -> None:
        self.state = "idle"
        self._counts = [0] * len(self.binding.params)
        self._missing = [len(b.params) for b in self.buckets]
        self._written = [False] * len(self.buckets)
        self._backwards = 0        # backward passes of this round that reached a parameter
        self._queued = False       # the end-of-backward callback of the running pass
        self.overrun = False

    def _on_grad(self, i: int, param) -> None:
        """After backward accumulated ``p.grad`` of parameter ``i``."""
        with self._lock:
            if self.state == "done":
                self.overrun = True  # a backward after the average, before step(): not in it
                return
            if self.paused:
                return
            self.state = "open"
            if not self._queued:
                # The first hook of a pass queues what autograd runs when the pass ends.
                queue_end_of_backward(self._end_of_backward)
                self._queued = True
            self._counts[i] += 1
            written = False
            if self._counts[i] == self.passes:
                b = self._of[i]
                self._missing[b] -= 1
                if self._missing[b] == 0:
                    self._write(b)
                    written = True
            if written or self.pipeline.busy:  # a hook also drives the allreduces under way
                # which rank's hook waits here depends on timing: watched, not counted
                with self.waiting("backward() hook", count=False):
                    self.pipeline.advance(block=False)
                if self.pipeline.busy:
                    self._wake.set()

    def _end_of_backward(self) -> None:
        """Autograd's last act in a backward pass that reached a parameter: after the
        ``passes``-th, finish the round, so that backward returns with the average (as DDP's)."""
        with self._lock:
            self._queued = False
            self._backwards += 1
            if self._backwards >= self.passes and self.state == "open":
                with self.waiting("backward()"):
                    self.complete()

    def _write(self, b: int) -> None:
        """Bucket ``b`` of this rank's slot holds its gradients (weighted): say so."""
        bucket = self.buckets[b]
        self.binding.gather(bucket.params)
        weight = self.weight() if bucket.params else 1.0  # the used-flags are not weighted
        if weight != 1.0:
            self.binding.scale_range(bucket.segment, bucket.lo, bucket.hi, weight)
        self.pipeline.post(_WRITTEN, b)
        self._written[b] = True

    def complete(self) -> None:
        """End the round (collective): write what backward did not (unused parameters, fewer
        passes than ``passes``), drive every bucket to the end, give the gradients the result."""
        with self._lock:
            for b in range(len(self.buckets)):
                if not self._written[b]:  # a parameter this backward did not reach (an unused branch)
                    self._write(b)
            self.pipeline.finish()
            self.pipeline.averager.settle()  # the codec's error feedback: kept if the averages are finite
            self.binding.scatter()
            self.state = "done"

    def consume(self) -> bool:
        """For ``synchronize()``: the round's average is in the gradients (completing it here
        if backward did not); returns whether a gradient came after it (an overrun)."""
        with self._lock:
            if self.state != "done":
                self.complete()
            overrun = self.overrun
            self._reset()
            return overrun

    def discard(self) -> None:
        """For ``zero_grad()``: drop the round; an open one is completed first, since the
        other ranks are averaging it."""
        with self._lock:
            if self.state == "open":
                self.complete()
            self._reset()

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self._poller is not None:
            self._closing = True
            self._wake.set()
            self._poller.join()
            self._poller = None
        self.pipeline.close()
