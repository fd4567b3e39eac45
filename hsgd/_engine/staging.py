"""Staged tensors: copied into this rank's slot before averaging and back after, in runs.

A staged tensor (on a GPU, or a CPU tensor with ``zero_copy=False``) cannot be a view into
the shared window, so :class:`~hsgd._engine.binding.SlotBinding` copies it in and out.
Copying each tensor on its own costs a synchronous transfer per tensor, at pageable speed.
Here the staged tensors are grouped into *runs*: consecutive layout entries of one segment
on one device. Each run on a GPU has one flat buffer on its device that mirrors the run's
span of the slot, padding included (on the CPU the span itself is the buffer), so that:

* ``gather`` copies each tensor into the run's device buffer (device to device), then the
  span crosses to the host in one copy per run (or per stretch of consecutive tensors, for a
  bucket), and the device is waited for once;
* ``scatter`` brings the span back in one copy per run, then each tensor takes its part
  (device to device).

On a GPU the slot's pages are page-locked with ``cudaHostRegister`` (portable), so the
transfers run at the pinned rate and without a bounce through a staging buffer; if
registering fails (a kernel or container that forbids it), the copies are synchronous and
:attr:`Staging.pinned` says why not. Registration is undone in :meth:`Staging.close`, after
the device's queue has drained, before the window is freed.

Ordering: every copy is queued on the tensor's device's current stream; ``gather`` waits
for that stream before it returns (the slot is then read by MPI and by other ranks), and a
``scatter``'s host-to-device copies finish before the next ``gather`` on the same stream
writes the slot again. :meth:`Staging.close` waits for the stream too.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

__all__ = ["Staging"]


@dataclass
class _Run:
    """Consecutive staged entries of one segment on one device, and their buffers."""

    members: List[int]  # the tensors' indices, in layout order
    starts: List[int]  # each member's offset from the run's first element
    numels: List[int]
    host: torch.Tensor  # the run's span of this rank's slot
    device_buffer: torch.Tensor  # the same span on the members' device
    device_views: List[torch.Tensor] = field(default_factory=list)  # each member's part, shaped like it


def _runs(places: Sequence[Tuple[int, int]], tensors: Sequence[torch.Tensor], staged: Sequence[bool],
          own) -> List[_Run]:
    """The runs of the staged ``tensors``: a run grows while the next tensor is staged, in the same
    segment and on the same device as the previous one."""
    groups: List[List[int]] = []
    for i, t in enumerate(tensors):
        if not staged[i]:
            continue
        if groups and groups[-1][-1] == i - 1 and places[i - 1][0] == places[i][0] \
                and tensors[i - 1].device == t.device:
            groups[-1].append(i)
        else:
            groups.append([i])
    runs = []
    for members in groups:
        seg, lo = places[members[0]]
        numels = [tensors[i].numel() for i in members]
        starts = [places[i][1] - lo for i in members]
        hi = lo + starts[-1] + numels[-1]
        first, host = tensors[members[0]], own(seg)[lo:hi]
        # on the CPU the slot is the buffer: each tensor is copied straight into its place
        buffer = host if first.device.type == "cpu" else torch.zeros(hi - lo, dtype=first.dtype, device=first.device)
        run = _Run(members, starts, numels, host, buffer)
        run.device_views = [buffer[s:s + n].view(tensors[i].shape) for i, s, n in zip(members, starts, numels)]
        runs.append(run)
    return runs


def _stretches(run: _Run, wanted: Optional[set]) -> Iterable[Tuple[int, int]]:
    """The element ranges of ``run`` to copy: the whole run, or each stretch of consecutive
    members in ``wanted`` (never a member outside it: its slot entry may hold an average already)."""
    if wanted is None:
        yield 0, run.starts[-1] + run.numels[-1]
        return
    lo = None
    for k, i in enumerate(run.members):
        if i in wanted:
            if lo is None:
                lo = run.starts[k]
            hi = run.starts[k] + run.numels[k]
        elif lo is not None:
            yield lo, hi
            lo = None
    if lo is not None:
        yield lo, hi


class Staging:
    """The staged tensors of a binding, in runs (module docstring). ``places[i]`` is tensor
    ``i``'s ``(segment, offset)``, ``own(segment)`` this rank's segment, ``staged[i]`` whether
    tensor ``i`` is staged; ``tensors[i]`` gives its device, dtype and shape."""

    def __init__(self, places: Sequence[Tuple[int, int]], tensors: Sequence[torch.Tensor],
                 staged: Sequence[bool], own) -> None:
        self.runs = _runs(places, tensors, staged, own)
        self._where: Dict[int, Tuple[_Run, int]] = {i: (run, k) for run in self.runs
                                                    for k, i in enumerate(run.members)}
        self._registered: List[int] = []  # page-locked host ranges' starts, to unregister
        self.pinned: Optional[str] = None  # None: page-locked, or not on a GPU; else why not
        gpu_runs = [run for run in self.runs if run.device_buffer.is_cuda]
        if gpu_runs:
            self.pinned = self._register([run.host for run in gpu_runs])

    def device_view(self, index: int) -> torch.Tensor:
        """Tensor ``index``'s part of its run's device buffer."""
        run, k = self._where[index]
        return run.device_views[k]

    def gather(self, values: Dict[int, Optional[torch.Tensor]]) -> None:
        """Put ``values`` (index -> the tensor's current value, ``None`` for zero) into the slot:
        each into its run's device buffer, then one host copy per stretch; waits for the devices."""
        with torch.no_grad():
            touched: Dict[int, Tuple[_Run, set]] = {}
            for i, value in values.items():
                run, k = self._where[i]
                view = run.device_views[k]
                view.zero_() if value is None else view.copy_(value)
                touched.setdefault(id(run), (run, set()))[1].add(i)
            for run, wanted in touched.values():
                if run.device_buffer is run.host:
                    continue
                whole = len(wanted) == len(run.members)
                for lo, hi in _stretches(run, None if whole else wanted):
                    run.host[lo:hi].copy_(run.device_buffer[lo:hi], non_blocking=self._async(run))
            self._wait(run for run, _ in touched.values())

    def scatter(self) -> None:
        """Bring every run's span back to its device buffer (then :meth:`device_view` holds the
        averages); queued on the device's stream, not waited for."""
        with torch.no_grad():
            for run in self.runs:
                if run.device_buffer is not run.host:
                    run.device_buffer.copy_(run.host, non_blocking=self._async(run))

    def close(self) -> None:
        """Wait for the queued copies, then undo the page-locking (before the slot is freed)."""
        self._wait(self.runs)
        for start in self._registered:
            torch.cuda.cudart().cudaHostUnregister(start)
        self._registered = []

    def _async(self, run: _Run) -> bool:
        return run.device_buffer.is_cuda and self.pinned is None

    @staticmethod
    def _wait(runs: Iterable[_Run]) -> None:
        for device in {run.device_buffer.device for run in runs if run.device_buffer.is_cuda}:
            torch.cuda.current_stream(device).synchronize()

    def _register(self, hosts: Sequence[torch.Tensor]) -> Optional[str]:
        """Page-lock the pages under ``hosts`` (merged, each page once); ``None``, or why not."""
        page = mmap.PAGESIZE
        spans = sorted((t.data_ptr() // page * page, -(-(t.data_ptr() + t.numel() * t.element_size()) // page) * page)
                       for t in hosts if t.numel())
        merged: List[List[int]] = []
        for lo, hi in spans:
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        cudart = torch.cuda.cudart()
        for lo, hi in merged:
            err = int(cudart.cudaHostRegister(lo, hi - lo, 1))  # 1: cudaHostRegisterPortable
            if err != 0:
                self.close()
                return (f"cudaHostRegister of {hi - lo} bytes of the shared window failed with cudaError {err}: "
                        "staging copies at the pageable rate")
            self._registered.append(lo)
        return None
