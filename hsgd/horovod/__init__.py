"""Horovod's PyTorch API (``horovod.torch``) on hsgd: change ``import horovod.torch as hvd`` to
``import hsgd.horovod as hvd`` and run the script under ``mpiexec`` or ``srun``.

``hvd.DistributedOptimizer`` averages with :class:`~hsgd.HierarchicalSGD` (shared memory in a
node, MPI across nodes); the collectives (``allreduce``, ``allgather``, ``broadcast``,
``alltoall``, ``reducescatter``, their ``_``, ``_async`` and grouped forms, ``barrier``,
``join``) run over MPI, matched by name across ranks (``hsgd.horovod.matching``), with
Horovod's semantics: mismatched tensors raise :class:`HorovodInternalError` on every rank.
What Horovod has and this does not (Adasum, ``SyncBatchNorm``, the timeline, elastic)
raises ``NotImplementedError`` saying what to use instead. docs/from-horovod.md has the
differences. Nothing starts MPI before a name is used (mostly ``hvd.init()``).
"""

from __future__ import annotations

import importlib
from typing import Any, NoReturn

_MODULES = {
    ".runtime": ("Average", "Sum", "Adasum", "Min", "Max", "Product", "HorovodInternalError", "is_initialized",
                 "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size", "is_homogeneous",
                 "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built",
                 "ddl_built", "ccl_built", "cuda_built", "rocm_built"),
    ".process_sets": ("init", "shutdown", "ProcessSet", "global_process_set", "add_process_set",
                      "remove_process_set"),
    ".tensor_ops": ("allreduce_async", "allreduce_async_", "allreduce_", "grouped_allreduce_async",
                    "grouped_allreduce_async_", "grouped_allreduce_", "allgather_async", "grouped_allgather_async",
                    "broadcast_async", "broadcast_async_", "broadcast_", "alltoall_async", "reducescatter_async",
                    "grouped_reducescatter_async", "sparse_allreduce_async", "poll", "synchronize", "barrier",
                    "join"),
    ".autograd_ops": ("Compression", "allreduce", "grouped_allreduce", "allgather", "grouped_allgather",
                      "broadcast", "alltoall", "reducescatter", "grouped_reducescatter"),
    ".state_sync": ("broadcast_object", "allgather_object", "broadcast_parameters", "broadcast_optimizer_state"),
    ".distributed_optimizer": ("DistributedOptimizer",),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}
_ELSEWHERE = {
    "elastic": "hsgd has no elastic Horovod; a job keeps its ranks (docs/reliability.md: faults end the job, "
               "checkpoints resume it)",
}

__all__ = [*_EXPORTS, "SyncBatchNorm", "start_timeline", "stop_timeline"]


class SyncBatchNorm:
    """Not provided: raises ``NotImplementedError``. Use ``torch.nn.BatchNorm*d`` and average the running
    statistics with ``hsgd.replicas.average_buffers(model)`` before evaluating."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("hsgd.horovod has no SyncBatchNorm: batch statistics stay per rank; use "
                                  "torch.nn.BatchNorm*d and hsgd.replicas.average_buffers(model) before evaluating")


def start_timeline(file_path: str, mark_cycles: bool = False) -> NoReturn:
    """Not provided: raises ``NotImplementedError`` (use ``torch.profiler``, or the trainer's ``--timeline``)."""
    raise NotImplementedError("hsgd.horovod has no timeline; use torch.profiler (hsgd's phases appear as "
                              "record_function ranges), or python -m hsgd.train --timeline FILE")


def stop_timeline() -> NoReturn:
    """Not provided: raises ``NotImplementedError`` (see :func:`start_timeline`)."""
    start_timeline("")


# Loaded on first use (PEP 562), as ``hsgd``'s names: ``import hsgd.horovod`` does not start MPI.
def __getattr__(name: str) -> Any:
    if name in _ELSEWHERE:
        raise NotImplementedError(f"hvd.{name}: {_ELSEWHERE[name]}")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hsgd.horovod' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
