"""``hvd.DistributedOptimizer``: Horovod's optimizer wrapper, averaging with :class:`~hsgd.HierarchicalSGD`.

The gradients are averaged by hsgd's hierarchical average (shared memory in the node, MPI
across nodes), in ``step()`` or ``synchronize()``, or in buckets during backward with
``overlap=True``; not by one allreduce per tensor. Horovod's arguments keep their meaning:
``op`` (Average or Sum), ``gradient_predivide_factor``, ``backward_passes_per_step``,
``compression`` (``Compression.fp16`` sends the sums that cross nodes in 16 bits), sparse
gradients (averaged dense, handed back sparse), ``process_set`` (a rank outside it steps on
its own gradients, as in Horovod). Before each average the ranks add up a one-integer token
(:mod:`hsgd.horovod.step_token`), so that a rank in ``hvd.join()`` averages zeros with them.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from .._core.agree import check_all
from .._engine.optimizer import InnerOptimizer
from ..errors import InputValueError
from ..hierarchical.synchronous import DEFAULT_BUCKET_MB, HierarchicalSGD
from ..topology import Topology
from .autograd_ops import Compression
from .matching import Matcher
from .process_sets import ProcessSet, global_process_set, matcher_of
from .runtime import Adasum, Average, Sum
from .step_token import StepToken
from .tensor_ops import register_overlap

__all__ = ["DistributedOptimizer"]

_STEP_WARNING = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                 "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
                 "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.")


def _named(optimizer: torch.optim.Optimizer, named_parameters) -> List[Tuple[str, torch.Tensor]]:
    """Horovod's checks and names: every optimizer parameter named once (default names
    ``allreduce.noname.<group>.<index>``)."""
    if named_parameters is None:
        return [(f"allreduce.noname.{i}.{j}", p) for i, group in enumerate(optimizer.param_groups)
                for j, p in enumerate(group["params"])]
    named = list(named_parameters)
    if any(not isinstance(p, tuple) for p in named):
        raise InputValueError("named_parameters should be a sequence of tuples (name, parameter), usually "
                              "produced by model.named_parameters().")
    seen: set = set()
    dups: set = set()
    for name, _ in named:
        (dups if name in seen else seen).add(name)
    if dups:
        raise InputValueError(f"Parameter names in named_parameters must be unique. Found duplicates: "
                              f"{', '.join(sorted(dups))}")
    unnamed = {id(p) for group in optimizer.param_groups for p in group["params"]} - {id(p) for _, p in named}
    if unnamed:
        raise InputValueError("named_parameters was specified, but one or more model parameters were not "
                              f"named. Python object ids: {', '.join(str(i) for i in sorted(unnamed))}")
    return named


def _check_groups(groups) -> None:
    if groups is None:
        return
    if not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
        raise InputValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
    seen = set()
    for group in groups if isinstance(groups, list) else ():
        for p in group:
            if not isinstance(p, torch.Tensor):
                raise InputValueError("groups must consist of torch.Tensor.")
            if id(p) in seen:
                raise InputValueError("A parameter can only appear once in groups.")
            seen.add(id(p))


def _check(optimizer, named_parameters, backward_passes_per_step, op, gradient_predivide_factor, groups):
    if gradient_predivide_factor != 1.0 and op != Average:
        raise InputValueError("gradient_predivide_factor not supported with op != Average")
    if backward_passes_per_step <= 0:
        raise InputValueError("backward_passes_per_step must be > 0")
    if op not in (Average, Sum):
        raise InputValueError("DistributedOptimizer averages (op=hvd.Average) or sums (op=hvd.Sum) the "
                              "gradients; for another reduction call hvd.allreduce_(p.grad, op=...) yourself")
    _check_groups(groups)
    return _named(optimizer, named_parameters)


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step: int = 1, op: int = Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups=None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set, *, overlap: bool = False,
                         bucket_cap_mb: float = DEFAULT_BUCKET_MB, inter_node: str = "leader") -> InnerOptimizer:
    """Wrap ``optimizer`` so that ``step()`` averages the gradients over ``process_set`` first.

    Horovod's arguments, as Horovod documents them; ``groups`` only shaped Horovod's tensor fusion
    and is checked and otherwise ignored (hsgd averages every gradient in one pass, or in buckets).
    hsgd's own, keyword-only: ``overlap`` (average in buckets during backward, as
    :class:`~hsgd.HierarchicalSGD`), ``bucket_cap_mb`` and ``inter_node``. Collective over
    ``process_set``; the result is a :class:`~hsgd.HierarchicalSGD` (``close()`` it when done).
    """
    if op == Adasum:
        raise NotImplementedError("hsgd.horovod has no Adasum; use op=hvd.Average (the default)")
    if compression not in (Compression.none, Compression.fp16):
        raise NotImplementedError("DistributedOptimizer compresses with Compression.none or Compression.fp16 only "
                                  "(hsgd.HierarchicalSGD(compression='bf16') for bfloat16)")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning, stacklevel=2)
        groups = num_groups if groups is None else groups
    args = (optimizer, named_parameters, backward_passes_per_step, op, gradient_predivide_factor, groups)
    if not process_set.included():
        return _LocalOptimizer(optimizer, _check(*args))
    matcher = matcher_of(process_set)
    named = check_all(matcher.ctl, _check, *args)
    topology = Topology.from_comm(matcher.ctl)
    try:
        return _HorovodSGD(optimizer, named, topology, matcher, op, gradient_predivide_factor,
                           compression="fp16" if compression is Compression.fp16 else "none",
                           backward_passes_per_step=backward_passes_per_step, overlap=overlap,
                           bucket_cap_mb=bucket_cap_mb, inter_node=inter_node)
    except BaseException:
        topology.close()
        raise


class _HorovodSGD(HierarchicalSGD):
    """:class:`~hsgd.HierarchicalSGD` with Horovod's ``op``, ``gradient_predivide_factor``, sparse
    gradients, the step warning and the step token that lets a joined rank take part."""

    def __init__(self, optimizer, named: List[Tuple[str, torch.Tensor]], topology: Topology, matcher: Matcher,
                 op: int, predivide: float, **settings: Any) -> None:
        self._hvd_op, self._predivide, self._matcher = op, predivide, matcher
        self._parameter_names: Dict[torch.Tensor, str] = {p: name for name, p in named}
        self._token: Optional[StepToken] = None
        super().__init__(optimizer, named_parameters=named, topology=topology, broadcast=False, **settings)
        if self.settings.overlap:
            register_overlap(self)
        else:
            ref = weakref.WeakMethod(self._joined_average)
            self._token = StepToken(matcher.ctl, lambda: (ref() or (lambda: None))())
            matcher.tokens.append(self._token)
        self.zero_grad(set_to_none=False)  # as Horovod: every trained parameter has a (zero) gradient

    def step_weight(self, level: str) -> float:
        """hsgd's weight, times the set size for ``op=Sum`` and divided by ``gradient_predivide_factor``."""
        scale = (self.topology.size if self._hvd_op == Sum else 1.0) / self._predivide
        return super().step_weight(level) * scale

    def synchronize(self) -> None:
        """Average the gradients now (Horovod's ``synchronize()``). Collective over the set."""
        self._check_open()
        if self._synchronized:
            return
        if self._token is not None:
            self._token.step()
        sparse = [(p, g) for p in self._params if (g := p.grad) is not None and g.is_sparse]
        for p, g in sparse:
            p.grad = g.to_dense()
        super().synchronize()
        with torch.no_grad():
            for p in self._params if self._predivide != 1.0 else ():
                if p.grad is not None:
                    p.grad.mul_(self._predivide)
            for p, g in sparse:
                if p.grad is not None:
                    p.grad = p.grad.to_sparse(g.sparse_dim())

    def _joined_average(self) -> None:
        """On a rank in ``hvd.join()``: the others' average, with zero gradients from this rank."""
        for p in self._params:
            p.grad = None
        HierarchicalSGD.synchronize(self)
        self._synchronized = False

    def step(self, closure=None):  # torch's overloads, as SyncMode.step
        """Average (unless :meth:`synchronize` or backward did), then the inner step; warns as
        Horovod does after ``synchronize()`` outside ``skip_synchronize()``."""
        if self._synchronized and not self._skip:
            warnings.warn(_STEP_WARNING, stacklevel=2)
        return super().step(closure)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Not supported: the setting is fixed at construction."""
        raise NotImplementedError("pass backward_passes_per_step= to hvd.DistributedOptimizer when building it")

    def _close(self) -> None:
        if self._token is not None:
            if self._token in self._matcher.tokens:
                self._matcher.tokens.remove(self._token)
            self._token.free()
        super()._close()
        self.topology.close()


class _LocalOptimizer(InnerOptimizer):
    """What ``DistributedOptimizer`` is on a rank outside its process set: the inner optimizer,
    stepping on this rank's own gradients (Horovod's behaviour)."""

    def __init__(self, optimizer: torch.optim.Optimizer, named: List[Tuple[str, torch.Tensor]]):
        self._init_optimizer_hooks()
        self.optimizer, self.num_steps, self._skip = optimizer, 0, False
        self._parameter_names = {p: name for name, p in named}

    def synchronize(self) -> None:
        """Nothing to average: this rank is not in the optimizer's process set."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """A block in which ``step()`` does not synchronize (it never does here)."""
        yield

    def step(self, closure=None):
        """The inner optimizer's step."""
        self.num_steps += 1
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner optimizer's ``zero_grad``."""
        self.optimizer.zero_grad(set_to_none)

    def close(self) -> None:
        """Nothing to free."""

