"""``compression="powersgd"``: each matrix's node sum crosses nodes as two low-rank factors, with error feedback.

PowerSGD (Vogels et al. 2019, https://arxiv.org/abs/1905.13727), as torch's
``powerSGD_hook`` runs it, but once per node on the node sum. For every matrix ``M``
(a tensor of two or more dimensions viewed as ``shape[0] x rest``) worth compressing
(``(n + m) r * min_compression_rate < n m``), after ``start_step`` uncompressed sums::

    C = M + E                       this node's sum plus its error
    P = sum over nodes of C Q       Q (m x r): last round's, the same on every node
    P := orthogonalize(P)           Gram-Schmidt (r <= 2) or QR, on the leader
    Q_i = C^T P;  E := C - P Q_i^T  this node's own approximation's error
    Q = sum over nodes of Q_i;  M := P Q^T

One sum carries every ``P`` and the tensors left uncompressed (vectors, small matrices, the
used-flags, exactly), a second every ``Q``. ``Q`` starts random (``seed``, the same on every
node), is warm-started from the last round, and orthogonalized before use. The state lives on
the node leader: per compressed matrix ``E``, the candidate ``C`` (twice the matrix) and ``Q``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Tuple

import torch

from .._core.checks import check_int
from .._core.settings import Real
from .._core.traffic import allreduce_bytes
from ..errors import InputValueError
from .codec import Channel, Codec, FeedbackChannel, Gathered, Part, Step, entry_ranges, sum_steps

__all__ = ["PowerSGD", "orthogonalize"]


def orthogonalize(matrix: torch.Tensor) -> None:
    """Make the columns of ``matrix`` (n x r) orthonormal in place, as torch's PowerSGD does:
    Gram-Schmidt for r <= 2, else QR. A column with no norm left stays zero (no NaN)."""
    if matrix.shape[1] > 2:
        q, _ = torch.linalg.qr(matrix)
        matrix.copy_(q)
        return
    for i in range(matrix.shape[1]):
        col = matrix[:, i:i + 1]
        norm = torch.linalg.vector_norm(col)
        if norm > 0:
            col /= norm
        else:
            col.zero_()
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1:]
            rest -= (col * rest).sum(dim=0, keepdim=True) * col


@dataclasses.dataclass(frozen=True)
class PowerSGD(Codec):
    """Low-rank node sums across nodes (the module doc), with error feedback per node.

    Args:
        rank: the rank of the factors (torch's ``matrix_approximation_rank``); a matrix
            ``n x m`` sends ``(n + m) * rank`` values instead of ``n * m``.
        start_step: sums of each tensor sent uncompressed first (torch's ``start_powerSGD_iter``).
        min_compression_rate: compress a matrix only if it sends this many times fewer values
            (>= 1); the others, and every vector, go uncompressed.
        seed: of the random first ``Q``, the same on every node.

    Needs ``inter_node="leader"`` (it compresses whole matrices).
    """

    rank: int = 4
    start_step: int = 10
    min_compression_rate: float = 2.0
    seed: int = 0
    feedback = True
    whole_tensors = True

    @property
    def name(self) -> str:
        return "powersgd"

    def check(self, name: str) -> None:
        check_int(f"{name}.rank", self.rank, 1)
        check_int(f"{name}.start_step", self.start_step, 0)
        check_int(f"{name}.seed", self.seed, 0)
        Real(1, finite=True, hint="(below 1 the factors hold more values than the matrix; torch's default: 2)")(
            f"{name}.min_compression_rate", self.min_compression_rate)

    def compresses(self, shape) -> bool:
        """Whether a tensor of ``shape`` is compressed (once past ``start_step``)."""
        if len(shape) < 2:
            return False
        n, m = shape[0], math.prod(shape[1:])
        return (n + m) * self.rank * self.min_compression_rate < n * m

    def check_layout(self, layout) -> None:
        matrices = [shape for i, shape in enumerate(layout.shapes) if len(shape) >= 2 and i not in layout.exact]
        if not matrices:
            raise InputValueError("PowerSGD compresses matrices, and the model has none (no tensor of two or "
                                  "more dimensions); use compression='int8' or 'fp16'")
        if not any(self.compresses(shape) for shape in matrices):
            n, m = max(((s[0], math.prod(s[1:])) for s in matrices), key=lambda nm: nm[0] * nm[1])
            most = max(0, math.ceil(n * m / ((n + m) * self.min_compression_rate)) - 1)
            raise InputValueError(
                f"PowerSGD(rank={self.rank}) compresses none of the model's matrices: the largest, {n}x{m}, "
                f"takes a rank of at most {most} at min_compression_rate={self.min_compression_rate:g}; "
                f"lower the rank" + ("" if most else " or min_compression_rate, or use compression='int8'"))

    def open(self, comm, layout, chunk_bytes: int) -> Channel:
        return _PowerChannel(comm, layout, self)


class _Matrix:
    """One compressed matrix's state: error ``E`` and ``Q`` (as summed), and the round's
    candidates of both (``C``, then the new error; the new ``Q``), and its ``P``."""

    def __init__(self, n: int, m: int, rank: int, dtype: torch.dtype, generator: torch.Generator):
        self.error = torch.zeros(n, m, dtype=dtype)
        self.candidate = torch.zeros(n, m, dtype=dtype)
        self.q = torch.randn(m, rank, generator=generator, dtype=torch.float64).to(dtype)
        self.q_next = self.q.clone()
        self.p = torch.empty(n, rank, dtype=dtype)

    def commit(self) -> None:
        self.error, self.candidate = self.candidate, self.error
        self.q, self.q_next = self.q_next, self.q


class _PowerChannel(FeedbackChannel):
    """PowerSGD's channel on a node leader: per part, one sum of the ``P`` factors and the
    uncompressed values, then (if it compressed any matrix) one sum of the ``Q`` factors."""

    def __init__(self, comm, layout, codec: PowerSGD):
        super().__init__()
        self.comm, self.layout, self.codec = comm, layout, codec
        self.generator = torch.Generator().manual_seed(codec.seed)
        self.summed: Dict[int, int] = {}  # entry -> sums it went through (start_step)
        self.matrices: Dict[int, _Matrix] = {}

    def _plan(self, part: Part):
        """The part's matrices to compress now (entry, lo, hi) and the ranges it sends as they are."""
        compress, exact = [], []
        for entry, lo, hi in entry_ranges(self.layout, part):
            shape = self.layout.shapes[entry]
            whole = (lo, hi) == (self.layout.places[entry][1], self.layout.places[entry][1] + self.layout.sizes[entry])
            due = self.summed.get(entry, 0) >= self.codec.start_step
            if whole and due and entry not in self.layout.exact and self.codec.compresses(shape):
                compress.append((entry, lo, hi))
            else:
                exact.append((lo, hi))
            if whole:
                self.summed[entry] = self.summed.get(entry, 0) + 1
        return compress, exact

    def _matrix(self, entry: int, dtype: torch.dtype) -> _Matrix:
        matrix = self.matrices.get(entry)
        if matrix is None:
            shape = self.layout.shapes[entry]
            matrix = _Matrix(shape[0], math.prod(shape[1:]), self.codec.rank, dtype, self.generator)
            self.matrices[entry] = matrix
        return matrix

    def steps(self, part: Part) -> Tuple[List[Step], int]:
        compress, exact = self._plan(part)
        dtype, parties = part.values.dtype, self.comm.Get_size()
        matrices = [(self._matrix(entry, dtype), part.values[lo - part.lo:hi - part.lo]) for entry, lo, hi in compress]
        for (entry, _, _), (matrix, _) in zip(compress, matrices):
            self._hold(entry, matrix, part)
        first = Gathered(part, exact, extra=sum(m.p.numel() for m, _ in matrices))
        steps = sum_steps(self.comm, first.flat, lambda: self._ps(first, matrices), first.scatter)
        sent = allreduce_bytes(first.flat.numel() * first.flat.element_size(), parties)
        if matrices:
            qs = torch.empty(sum(m.q.numel() for m, _ in matrices), dtype=dtype)
            steps += sum_steps(self.comm, qs, lambda: self._qs(first, matrices, qs),
                               lambda: self._decompress(matrices, qs))
            sent += allreduce_bytes(qs.numel() * qs.element_size(), parties)
        return steps, sent

    def _ps(self, first: Gathered, matrices) -> None:
        """Before the first sum: the uncompressed values, then each ``P = (M + E) Q``."""
        first.gather()
        at = first.numel
        for matrix, values in matrices:
            matrix.candidate.copy_(values.view_as(matrix.candidate)).add_(matrix.error)  # C = M + E
            q = matrix.q_next.copy_(matrix.q)  # the warm start, orthogonalized; the sum of the Q_i later
            _revive(q, self.generator)
            orthogonalize(q)
            p = first.flat[at:at + matrix.p.numel()].view_as(matrix.p)
            torch.matmul(matrix.candidate, q, out=p)
            at += matrix.p.numel()

    def _qs(self, first: Gathered, matrices, qs: torch.Tensor) -> None:
        """Between the sums (compute on the leader): orthogonalize each summed ``P``, this
        node's ``Q_i = C^T P`` and its error ``C - P Q_i^T``."""
        at, q_at = first.numel, 0
        for matrix, _ in matrices:
            matrix.p.copy_(first.flat[at:at + matrix.p.numel()].view_as(matrix.p))
            at += matrix.p.numel()
            orthogonalize(matrix.p)
            q = qs[q_at:q_at + matrix.q.numel()].view_as(matrix.q)
            torch.matmul(matrix.candidate.t(), matrix.p, out=q)
            matrix.candidate.sub_(matrix.p @ q.t())  # the candidate error
            q_at += matrix.q.numel()

    def _decompress(self, matrices, qs: torch.Tensor) -> None:
        """After the second sum: ``M := P Q^T``; ``Q`` is the next round's warm start."""
        q_at = 0
        for matrix, values in matrices:
            matrix.q_next.copy_(qs[q_at:q_at + matrix.q.numel()].view_as(matrix.q))
            q_at += matrix.q.numel()
            torch.matmul(matrix.p, matrix.q_next.t(), out=values.view(matrix.p.shape[0], -1))

    def state_dict(self) -> Dict[str, Any]:
        return {"summed": {str(e): n for e, n in self.summed.items()},
                "error": {str(e): m.error.clone() for e, m in self.matrices.items()},
                "q": {str(e): m.q.clone() for e, m in self.matrices.items()},
                "generator": self.generator.get_state()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._pending.clear()
        self.summed = {int(e): int(n) for e, n in state["summed"].items()}
        self.generator.set_state(state["generator"])
        self.matrices = {}
        for key, error in state["error"].items():
            matrix = _Matrix(error.shape[0], error.shape[1], self.codec.rank, error.dtype, torch.Generator())
            matrix.error.copy_(error)
            matrix.q.copy_(state["q"][key])
            self.matrices[int(key)] = matrix


def _revive(q: torch.Tensor, generator: torch.Generator) -> None:
    """Columns of ``Q`` with no norm (a matrix whose sum was zero) start random again: else they
    would stay zero for good. ``Q`` and the generator are the same on every node, so is this."""
    dead = torch.linalg.vector_norm(q, dim=0) == 0
    if bool(dead.any()):
        fresh = torch.randn(q.shape[0], int(dead.sum()), generator=generator, dtype=torch.float64)
        q[:, dead] = fresh.to(q.dtype)

