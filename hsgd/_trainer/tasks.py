"""What the trainer does with a batch: classify it, or model its language.

A :class:`Task` is the one place where the two workloads differ: how a batch from the
loader becomes the model's input and target, the loss, what counts as correct, the
synthetic batch of ``--balance``'s warm-up, the evaluation batch, and the fields of
the epoch record. The loop, evaluation and load balancing call the task and never ask
which one it is. :func:`choose_task` picks the task from the data (``kind="tokens"``,
written by ``python -m hsgd.data text``, is language modelling; anything else is
classification) and checks that ``--model`` fits it.

A batch's loss is the mean over its tokens (or samples); the sums behind the epoch
means count in samples (contexts), each weighted by its mean, which is the mean over
tokens since every context has the same length.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import h5py
import torch
from torch.nn import functional as F

from .._core.agree import on_root
from .._io.tokens import TOKENS_KIND, VOCAB_SIZE
from ..errors import InputValueError
from .models import CLASSIFIERS

__all__ = ["Task", "Classification", "LanguageModelling", "choose_task", "data_kind"]


class Task:
    """The workload's side of a training step and of evaluation (see the module docstring)."""

    #: what the model's output is scored against: classes or the vocabulary
    num_classes: int
    #: the largest evaluation batch per rank, in samples
    eval_batch: int = 1024

    def inputs(self, batch, device) -> Tuple[torch.Tensor, torch.Tensor]:
        """A loader batch ``(x, y, ...)`` as the model's input and the target, on ``device``."""
        raise NotImplementedError

    def loss(self, out, y) -> torch.Tensor:
        """The mean loss of a batch (what backward runs on)."""
        raise NotImplementedError

    def score(self, out, y) -> Tuple[float, float]:
        """``(correct, samples)`` of a batch: samples counted correct (fractions of them for
        tokens), and how many samples it had."""
        raise NotImplementedError

    def sums(self, out, y) -> Tuple[float, float, float]:
        """``(loss sum, correct, samples)``: the sums of an evaluation."""
        correct, samples = self.score(out, y)
        return self.loss(out, y).item() * samples, correct, samples

    def metrics(self, train_loss: float, train_acc: float, test_loss: float, test_acc: float) -> dict:
        """The epoch record's fields for these means."""
        return dict(train_loss=train_loss, train_acc=train_acc, test_loss=test_loss, test_acc=test_acc)

    def synthetic(self, rows: int, sample_shape: Sequence[int], generator, device):
        """A batch ``(x, y)`` of ``rows`` made-up samples on ``device``, as the loader gives one
        (``--balance``'s warm-up: :meth:`inputs` of its first ``b`` rows is a step's work)."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


class Classification(Task):
    """One integer label per sample; inputs of any numeric dtype fed as float32, unscaled.

    ``cross_entropy(out, y)``, top-1 accuracy. Epoch records: ``train_loss``, ``train_acc``,
    ``test_loss``, ``test_acc``."""

    def __init__(self, num_classes: int):
        self.num_classes = int(num_classes)

    def inputs(self, batch, device):
        x = batch[0].to(device, torch.float32, non_blocking=True)  # any stored dtype, e.g. uint8 images
        return x, batch[1].to(device, non_blocking=True)

    def loss(self, out, y):
        return F.cross_entropy(out, y)

    def score(self, out, y):
        return float((out.argmax(1) == y).sum().item()), float(y.numel())

    def sums(self, out, y):
        correct, samples = self.score(out, y)
        return F.cross_entropy(out, y, reduction="sum").item(), correct, samples

    def synthetic(self, rows, sample_shape, generator, device):
        x = torch.randn(rows, *sample_shape, generator=generator).to(device)
        return x, torch.zeros(rows, dtype=torch.long, device=device)

    def describe(self) -> str:
        return f"{self.num_classes} classes"


class LanguageModelling(Task):
    """Next-token prediction at every position of blocks of tokens; ``context``: the model's
    longest input (``None``: the whole block); ``block``: the data's block length, which sets
    the evaluation batch to about 64 Ki tokens (the logits are tokens x vocabulary floats).

    x and y are int64 tokens of shape ``(B, T)`` (y: the next token at every position); the
    loss is the cross-entropy over every position, the score next-token accuracy. A block
    longer than the model's context is cut into ``T // context`` contexts (the rest of the
    block is not used). Epoch records add ``train_bpb`` and ``test_bpb``: bits per byte,
    the loss in nats over ln 2 (one token is one byte)."""

    def __init__(self, vocab_size: int = VOCAB_SIZE, context: Optional[int] = None, block: int = 1):
        self.num_classes, self.context = int(vocab_size), context
        self.eval_batch = max(1, (1 << 16) // max(1, block))

    def inputs(self, batch, device):
        x, y = (t.to(device, torch.long, non_blocking=True) for t in batch[:2])
        length = x.shape[1]
        if self.context is not None and self.context < length:
            cut = length // self.context * self.context
            x, y = (t[:, :cut].reshape(-1, self.context) for t in (x, y))
        return x, y

    def loss(self, out, y):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def score(self, out, y):
        positions = y.shape[1] if y.dim() > 1 else 1
        return (out.argmax(-1) == y).sum().item() / positions, float(len(y))

    def metrics(self, train_loss, train_acc, test_loss, test_acc):
        return dict(super().metrics(train_loss, train_acc, test_loss, test_acc),
                    train_bpb=train_loss / math.log(2), test_bpb=test_loss / math.log(2))

    def synthetic(self, rows, sample_shape, generator, device):
        x = torch.randint(0, self.num_classes, (rows, *sample_shape), generator=generator).to(device)
        return x, torch.zeros_like(x)

    def describe(self) -> str:
        context = "" if self.context is None else f", context {self.context}"
        return f"vocabulary {self.num_classes}{context}"


def data_kind(path: str, comm) -> dict:
    """The training file's ``kind`` and ``vocab_size`` attributes as rank 0 reads them
    (``{}`` if unreadable: the loader says why)."""
    def read():
        try:
            with h5py.File(path, "r") as f:
                attrs = f.attrs
                kind = attrs.get("kind")
                return {"kind": kind.decode() if isinstance(kind, bytes) else kind,
                        "vocab_size": int(attrs.get("vocab_size", VOCAB_SIZE))}
        except Exception:  # noqa: BLE001 - the loader reports a bad file itself
            return {}
    return on_root(comm, read)


def choose_task(model: str, info: dict, path: str, sample_shape, label_shape, classes: int,
                context: int) -> Task:
    """The task for ``--model model`` on the data ``info`` (:func:`data_kind`) describes,
    or an InputValueError saying what to change. ``classes``: 1 + the largest training label;
    ``context``: gpt's ``--block-size``."""
    sample_shape, label_shape = tuple(sample_shape), tuple(label_shape)
    if info.get("kind") == TOKENS_KIND:
        if model in CLASSIFIERS:
            raise InputValueError(f"--model {model} is a classifier, and {path} holds tokens (kind='tokens', "
                                  f"from python -m hsgd.data text): use --model gpt or your own "
                                  f"package.module:factory, or classification data")
        if label_shape != sample_shape:
            raise InputValueError(f"token data needs a next-token label at every position, y of x's shape; "
                                  f"{path} has samples {sample_shape} and labels {label_shape}: write it with "
                                  f"python -m hsgd.data text")
        vocab = info.get("vocab_size", VOCAB_SIZE)
        if classes > vocab:
            raise InputValueError(f"{path} has token labels up to {classes - 1}, outside its vocabulary of "
                                  f"{vocab} (attribute vocab_size); fix the data or the attribute")
        return LanguageModelling(vocab, context if model == "gpt" else None, block=math.prod(sample_shape))
    if model == "gpt":
        raise InputValueError(f"--model gpt models language and needs token data; {path} is not token data "
                              f"(no attribute kind='tokens'). Leave out --data for the default corpus (the "
                              f"Python standard library's sources) or write one with python -m hsgd.data "
                              f"text FILES -o tokens.h5")
    if label_shape:
        raise InputValueError(f"{path} has labels of shape {label_shape} per sample; classification takes one "
                              f"integer per sample (flatten them with y.reshape(-1)); token data carries "
                              f"kind='tokens' (python -m hsgd.data text)")
    return Classification(classes)
