"""The trainer's models, built from the data's sample shape and class count (or vocabulary).

``mlp`` (:class:`MLP`), ``cnn`` (:class:`ConvNet1d`) and ``resnet`` (:class:`ResNet`)
classify (:data:`CLASSIFIERS`); ``gpt`` (:mod:`hsgd._trainer.gpt`) models language on
token data (``python -m hsgd.data text``; ``--n-layer``, ``--n-head``, ``--n-embd``,
``--block-size``, its context, at most the data's blocks); ``package.module:factory``
is your own model (:mod:`hsgd._trainer.factory`).

Example::

    >>> model = build_model("cnn", sample_shape=(40,), num_classes=10)
    >>> model = build_model("gpt", sample_shape=(256,), num_classes=256, gpt=GPTConfig(block_size=128))
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from ..errors import InputValueError
from .factory import build_from_factory, is_factory, spec_problem
from .gpt import GPT, GPTConfig

__all__ = ["build_model", "model_problem", "MODELS", "CLASSIFIERS", "WIDTHS", "GPTConfig"]

MODELS = ("mlp", "cnn", "resnet", "gpt")
#: The built-in models that classify (the others: ``gpt``, language modelling).
CLASSIFIERS = ("mlp", "cnn", "resnet")
#: Each model's default width (``--width``): hidden units, channels, first-stage channels.
WIDTHS = {"mlp": 100, "cnn": 25, "resnet": 16}


class MLP(nn.Module):
    """``mlp``: the MNIST-1D paper's MLP (Greydanus 2020): flatten, two hidden layers of 100
    ReLU units (``width``)."""

    def __init__(self, in_features: int, num_classes: int, hidden: int = 100):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.net(x)


class ConvNet1d(nn.Module):
    """``cnn``: the MNIST-1D paper's CNN for 1-D signals: three ``Conv1d`` layers of 25
    channels (``width``; kernel 5 then 3 and 3, stride 2, padding 1, ReLU) and a linear
    read-out. Samples are ``(L,)`` (one channel) or ``(C, L)``."""

    def __init__(self, sample_shape: Sequence[int], num_classes: int, channels: int = 25):
        super().__init__()
        self.in_channels = 1 if len(sample_shape) == 1 else sample_shape[0]
        self.features = nn.Sequential(
            nn.Conv1d(self.in_channels, channels, 5, stride=2, padding=1), nn.ReLU(),
            nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten())
        with torch.no_grad():
            width = self.features(torch.zeros(1, self.in_channels, sample_shape[-1])).shape[1]
        self.linear = nn.Linear(width, num_classes)

    def forward(self, x):
        return self.linear(self.features(x.view(x.shape[0], self.in_channels, x.shape[-1])))


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = nn.Sequential()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.bn1(self.conv1(x)).relu()
        return (self.bn2(self.conv2(out)) + self.skip(x)).relu()


class ResNet(nn.Module):
    """``resnet``: a small ResNet for images (He et al. 2016, the CIFAR variant with three
    stages of 16/32/64 channels, ``width`` 16, and one basic block per stage). Samples are
    ``(C, H, W)`` or ``(H, W, C)`` (channels-last is detected when the last dimension is
    1, 3 or 4 and the first is not)."""

    def __init__(self, in_channels: int, num_classes: int, channels_last: bool,
                 widths: Sequence[int] = (16, 32, 64)):
        super().__init__()
        self.channels_last = channels_last
        self.stem = nn.Sequential(nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU())
        blocks, cin = [], widths[0]
        for i, width in enumerate(widths):
            blocks.append(_Block(cin, width, 1 if i == 0 else 2))
            cin = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes))

    def forward(self, x):
        if self.channels_last:
            x = x.permute(0, 3, 1, 2)
        return self.head(self.blocks(self.stem(x)))


def _is_channels_last(shape: Sequence[int]) -> bool:
    return shape[-1] in (1, 3, 4) and shape[0] not in (1, 3, 4)


def model_problem(name: str) -> Optional[str]:
    """What is wrong with ``--model name`` before anything is built, or None."""
    if name in MODELS:
        return None
    if is_factory(name):
        return spec_problem(name)
    return (f"--model {name!r} is not a built-in model ({' | '.join(MODELS)}); give your own as "
            f"package.module:factory, e.g. mypkg.models:build")


def build_model(name: str, sample_shape: Sequence[int], num_classes: int,
                width: Optional[int] = None, gpt: Optional[GPTConfig] = None) -> nn.Module:
    """Build model ``name`` for samples of ``sample_shape`` and ``num_classes`` classes (for
    ``gpt`` and token data: the vocabulary size); ``width``: the mlp's hidden units, the cnn's
    channels or the resnet's first-stage channels (``None``: the defaults of :data:`WIDTHS`);
    ``gpt``: the transformer's shape (``None``: :class:`GPTConfig`'s defaults). A name with a
    colon is your own factory (:func:`~hsgd._trainer.factory.build_from_factory`).

    Raises ``InputValueError`` naming the model and the shapes it accepts when the
    data does not fit it.
    """
    shape = tuple(int(s) for s in sample_shape)
    if is_factory(name):
        return build_from_factory(name, shape, num_classes)
    if name not in MODELS:
        raise InputValueError(model_problem(name))
    if name == "gpt":
        return _build_gpt(shape, num_classes, gpt or GPTConfig())
    if width is not None and width < 1:
        raise InputValueError(f"the model's width must be positive, got {width}")
    width = WIDTHS[name] if width is None else int(width)
    if num_classes < 2:
        raise InputValueError(f"the labels have {num_classes} class(es); a classifier needs at least 2")
    if name == "mlp":
        return MLP(int(torch.Size(shape).numel()), num_classes, hidden=width)
    if name == "cnn":
        if len(shape) not in (1, 2) or shape[-1] < 8:
            raise InputValueError(f"model 'cnn' takes 1-D signals of shape (L,) or (C, L) with L >= 8; "
                                  f"the data has samples of shape {shape}. Use --model mlp or resnet")
        return ConvNet1d(shape, num_classes, channels=width)
    if len(shape) != 3:
        raise InputValueError(f"model 'resnet' takes images of shape (C, H, W) or (H, W, C); the data "
                              f"has samples of shape {shape}. Use --model cnn for 1-D signals")
    channels_last = _is_channels_last(shape)
    return ResNet(shape[-1] if channels_last else shape[0], num_classes, channels_last,
                  widths=(width, 2 * width, 4 * width))


def _build_gpt(shape, vocab_size: int, cfg: GPTConfig) -> GPT:
    if len(shape) != 1:
        raise InputValueError(f"model 'gpt' takes blocks of tokens, samples of shape (T,); the data has "
                              f"samples of shape {shape}. Write token data with python -m hsgd.data text")
    if cfg.block_size > shape[0]:
        raise InputValueError(f"--block-size {cfg.block_size} is longer than the data's blocks of {shape[0]} "
                              f"tokens; use --block-size <= {shape[0]}, or write the data with "
                              f"python -m hsgd.data text --block-size {cfg.block_size}")
    if cfg.n_embd % cfg.n_head:
        raise InputValueError(f"--n-embd {cfg.n_embd} must be a multiple of --n-head {cfg.n_head}")
    return GPT(GPTConfig(vocab_size=vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer,
                         n_head=cfg.n_head, n_embd=cfg.n_embd))
