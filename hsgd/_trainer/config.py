"""The trainer's configuration: one dataclass, each field with its own help.

``python -m hsgd.train --help`` is generated from :class:`TrainConfig`, so
every option documents itself with its default. The synchronization modes'
options are not declared here: :class:`TrainConfig` extends their dataclass,
derived from the modes' settings (:mod:`hsgd._trainer.mode_flags`). :func:`parse_config` builds
the config from the command line and :meth:`TrainConfig.validate` returns the
first problem as a message that says what to change (the trainer prints it
once, from rank 0, and exits with status 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple, Union, get_type_hints

from .._core.agree import collective_error
from ..errors import InputValueError
from ..modes import SYNC_MODES
from .mode_flags import ModeFlags, mode_flags, mode_problem, mode_settings
from .models import GPTConfig, model_problem
from .saving import parse_save_every

__all__ = ["TrainConfig", "parse_config", "default_cache_dir"]


def _opt(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


def default_cache_dir() -> str:
    """``$HSGD_CACHE_DIR``, else ``$XDG_CACHE_HOME/hsgd``, else ``~/.cache/hsgd``."""
    if os.environ.get("HSGD_CACHE_DIR"):
        return os.environ["HSGD_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hsgd")


@dataclass
class TrainConfig(ModeFlags):
    """The trainer's options: its own fields below, and the modes' (:data:`ModeFlags`)."""

    # --- data ---
    data: Optional[str] = _opt(None, "HDF5 training file; default: MNIST-1D, generated into --cache-dir on first use")
    x_key: str = _opt("x_train", "data set of inputs in --data")
    y_key: str = _opt("y_train", "data set of integer labels in --data")
    test_data: Optional[str] = _opt(None, "HDF5 file with the test split; default: the --data file")
    test_x_key: str = _opt("x_test", "data set of test inputs")
    test_y_key: str = _opt("y_test", "data set of test labels")
    cache_dir: str = _opt(None, "where the default MNIST-1D file is generated (env HSGD_CACHE_DIR)")
    mnist1d_samples: int = _opt(40000, "training samples of the generated MNIST-1D, plus a quarter as many "
                                         "test samples (10000 for 40000)")
    # --- model and optimizer ---
    model: str = _opt("cnn", "mlp | cnn (1-D signals) | resnet (images) | gpt (a small transformer over "
                             "byte tokens; without --data it trains on the Python standard library's sources) "
                             "| package.module:factory (your own: called as factory(sample_shape=..., "
                             "num_classes=...), returning a torch.nn.Module)", metavar="MODEL")
    width: Optional[int] = _opt(None, "the model's width: hidden units of mlp (100), channels of cnn (25), "
                                      "channels of resnet's first stage (16; then 2x and 4x); a wider model "
                                      "has more parameters to average per step")
    n_layer: int = _opt(4, "gpt: transformer blocks")
    n_head: int = _opt(4, "gpt: attention heads per block (a divisor of --n-embd)")
    n_embd: int = _opt(128, "gpt: embedding width")
    block_size: int = _opt(128, "gpt: context length in tokens, at most the data's blocks (longer blocks are "
                                "cut into contexts of this length); the default corpus is written in blocks "
                                "of this length")
    corpus_bytes: int = _opt(0, "gpt without --data: use the first N bytes of the standard library's sources "
                                "(0: all, about 31 MB); written once into --cache-dir")
    optimizer: str = _opt("adamw", "sgd | lars | adamw", choices=["sgd", "lars", "adamw"])
    lr: float = _opt(0.01, "peak learning rate (before --scale-lr)")
    momentum: float = _opt(0.9, "momentum (sgd, lars)")
    nesterov: bool = _opt(False, "Nesterov momentum (sgd, lars)")
    weight_decay: float = _opt(0.0, "weight decay (decoupled for adamw; not applied to 1-D tensors by lars)")
    clip_grad_norm: float = _opt(0.0, "clip the gradients' L2 norm over all parameters to this before each update "
                                      "(torch's clip_grad_norm_; 1.0 is usual for a transformer): --sync sync "
                                      "clips the averaged gradients, the same on every rank; the other modes "
                                      "each rank's own before its local step; 0: no clipping")
    trust_coefficient: float = _opt(0.001, "LARS trust coefficient eta")
    scale_lr: bool = _opt(False, "linear scaling rule: lr *= global batch / --base-batch")
    base_batch: int = _opt(256, "reference batch of the linear scaling rule")
    schedule: str = _opt("poly", "constant | poly (warm-up, then (1-t/T)^power) | step (warm-up, "
                                 "then x0.1 at --milestones)", choices=["constant", "poly", "step"])
    warmup_epochs: Optional[float] = _opt(None, "linear warm-up length in epochs (0 for none); "
                                                "default: 1, or a tenth of --epochs if that is less")
    power: float = _opt(2.0, "power of the poly decay")
    milestones: List[int] = _opt(None, "epochs at which the step schedule multiplies lr by 0.1", nargs="+")
    # --- training ---
    epochs: int = _opt(30, "passes over the training data")
    batch_size: int = _opt(256, "global batch (all ranks together), kept at any rank count: each rank takes "
                                "batch/world, the first (batch mod world) ranks one sample more")
    seed: int = _opt(0, "seed of model init and data order")
    threads: int = _opt(0, "torch threads per rank; 0: $SLURM_CPUS_PER_TASK, else $OMP_NUM_THREADS, "
                                    "else cores / ranks on this node")
    device: str = _opt("cpu", "cpu | cuda (one GPU per rank on its host) | auto", choices=["cpu", "cuda", "auto"])
    amp: str = _opt("none", "mixed precision: none | bf16 (forward and loss autocast to bfloat16) | fp16 "
                            "(autocast to float16, the loss scaled by a GradScaler); on the CPU a child "
                            "process tries it first: where it would crash (bf16 kernels on a CPU whose "
                            "AMX is not enabled) the run stops with an error saying what to set",
                    choices=["none", "bf16", "fp16"])
    # --- synchronization ---
    sync: str = _opt("sync", "synchronization mode: sync (synchronous SGD, gradients averaged "
                             "every step) | local (hierarchical local SGD, parameters averaged "
                             "every --intra-period steps in the node) | diloco (local SGD whose global "
                             "round is DiLoCo's outer step, --outer-lr, --fragments) | elastic (SEASGD against "
                             "global weights in remote memory) | async (asynchronous SGD against "
                             "them) | gossip (averaging with a few peers per step, "
                             "--gossip-graph, --gossip-theta)", choices=list(SYNC_MODES))
    ranks_per_node: Optional[int] = _opt(None, "virtual node size (env HSGD_RANKS_PER_NODE); default: physical nodes")
    # --- output ---
    run_dir: Optional[str] = _opt(None, "where config.json and metrics.jsonl go; default runs/<time>")
    log_every: int = _opt(20, "steps between step records in metrics.jsonl")
    progress: str = _opt("auto", "auto (bar on a terminal, else one line per epoch) | bar | lines | none",
                         choices=["auto", "bar", "lines", "none"])
    tensorboard: bool = _opt(False, "also write the metrics as TensorBoard event files to "
                                    "RUN_DIR/tensorboard (needs the tensorboard package)")
    timeline: Optional[str] = _opt(None, "write a Chrome-trace JSON of every rank's phases here")
    checkpoint_dir: Optional[str] = _opt(None, "where checkpoints go; default RUN_DIR/checkpoints")
    save_every: str = _opt("0", "also checkpoint every N steps (e.g. 100) or every N seconds (e.g. 30s, 5m); "
                                "0: at the end of every epoch only. The state is gathered at the step and "
                                "written in the background while training goes on", metavar="N|Ns|Nm")
    nonfinite_limit: int = _opt(5, "--sync sync: skip a step whose averaged gradients hold NaN or Inf, and "
                                   "stop after this many in a row (with --amp fp16 the GradScaler's skipped "
                                   "steps count, each halving the loss scale); 0: no check")
    keep_checkpoints: int = _opt(3, "how many of the newest checkpoints to keep (--resume falls back to "
                                    "an older one if the newest is damaged)")
    resume: Optional[str] = _opt(None, "resume from the latest checkpoint in --checkpoint-dir (plain "
                                       "--resume; none there: start afresh) or from a given file",
                                 nargs="?", const="latest")
    stop_after: int = _opt(0, "stop (with a checkpoint) after this many steps in this run; 0: no limit")
    balance: bool = _opt(False, "load balancing: per-rank batch sizes that make every rank's step take "
                                "equally long (a warm-up, then re-measured every epoch), the global batch "
                                "unchanged and averages weighted by batch size (--sync sync | local | diloco)")
    straggler: Optional[str] = _opt(None, "RANK:FACTOR: make rank RANK's steps FACTOR (>= 1) times longer, "
                                          "busy-waiting after each step, to see how a mode copes with "
                                          "a slow worker (e.g. 3:3)", metavar="RANK:FACTOR")

    def validate(self) -> Optional[str]:
        """The first problem with this config, as an instruction; ``None`` if fine."""
        positive = {"lr": self.lr, "epochs": self.epochs, "batch_size": self.batch_size,
                    "log_every": self.log_every, "base_batch": self.base_batch,
                    "mnist1d_samples": self.mnist1d_samples, "power": self.power,
                    "keep_checkpoints": self.keep_checkpoints}
        for name, value in positive.items():
            if not value > 0:
                return f"--{name.replace('_', '-')} must be positive, got {value}"
        try:
            parse_save_every(self.save_every)
        except ValueError as exc:
            return str(exc)
        for name in ("momentum", "weight_decay", "threads", "stop_after", "nonfinite_limit"):
            if getattr(self, name) < 0:
                return f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}"
        if not (self.clip_grad_norm >= 0 and math.isfinite(self.clip_grad_norm)):
            return (f"--clip-grad-norm must be a finite number >= 0 (1.0 is usual; 0: no clipping), "
                    f"got {self.clip_grad_norm}")
        if not 0 <= self.momentum < 1:
            return f"--momentum must be in [0, 1) (0.9 is usual, 0 disables it), got {self.momentum}"
        problem = mode_problem(self)
        if problem:
            return problem
        straggler = self._straggler()
        if isinstance(straggler, str):
            return straggler
        if self.balance and not SYNC_MODES[self.sync].balances:
            weighted = [name for name, mode in SYNC_MODES.items() if mode.balances]
            return (f"--balance needs a mode that weights ranks by batch size: --sync {' | '.join(weighted)} "
                    f"(got --sync {self.sync})")
        if self.amp == "fp16" and getattr(mode_settings(self), "overlap", False):
            return ("--overlap averages the gradients during backward, before the GradScaler of --amp fp16 "
                    "can unscale them: use --amp bf16 (no GradScaler) or drop --overlap")
        if self.nesterov and self.momentum == 0 and self.optimizer in ("sgd", "lars"):
            return "--nesterov needs --momentum > 0 (e.g. --momentum 0.9); or drop --nesterov"
        if not self.trust_coefficient > 0:
            return (f"--trust-coefficient must be positive (0.001 in the LARS paper), "
                    f"got {self.trust_coefficient}")
        if self.warmup_epochs is not None and self.warmup_epochs < 0:
            return f"--warmup-epochs must be >= 0, got {self.warmup_epochs}"
        if self.warmup() >= self.epochs and self.schedule != "constant":
            return f"--warmup-epochs ({self.warmup_epochs}) must be shorter than --epochs ({self.epochs})"
        problem = self._milestones_problem() if self.schedule == "step" else None
        if problem:
            return problem
        if self.width is not None and self.width <= 0:
            return f"--width must be positive (the mlp's default is 100), got {self.width}"
        problem = self._model_problem()
        if problem:
            return problem
        if self.ranks_per_node is not None and self.ranks_per_node <= 0:
            return f"--ranks-per-node must be positive, got {self.ranks_per_node}"
        if self.resume == "latest" and not (self.checkpoint_dir or self.run_dir):
            return "--resume needs --checkpoint-dir or --run-dir to find the latest checkpoint"
        return None

    def ignored_flags(self) -> List[str]:
        """Flags of other synchronization modes set away from their default: --sync's mode ignores them."""
        mine = set(mode_flags(self.sync))
        others = {name for sync in SYNC_MODES for name in mode_flags(sync)} - mine
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return [f"--{name.replace('_', '-')}" for name in sorted(others)
                if getattr(self, name) != defaults[name]]

    def _straggler(self) -> Union[None, str, Tuple[int, float]]:
        """``--straggler`` as ``(rank, factor)``, ``None`` if unset, or a problem as a ``str``."""
        if self.straggler is None:
            return None
        rank_text, _, factor_text = self.straggler.partition(":")
        try:
            rank, factor = int(rank_text), float(factor_text)
        except ValueError:
            rank, factor = -1, 0.0
        if rank < 0 or not 1 <= factor < float("inf"):
            return (f"--straggler takes RANK:FACTOR, a rank >= 0 and a factor >= 1 (e.g. 3:3 makes rank 3's "
                    f"steps 3 times longer), got {self.straggler!r}")
        return rank, factor

    def straggler_factor(self, rank: int, world_size: int) -> float:
        """How many times longer ``rank``'s steps are made (1.0: not slowed). The same check on
        every rank: a ``--straggler`` rank outside the job raises an agreed ``InputValueError``."""
        straggler = self._straggler()
        if straggler is None:
            return 1.0
        assert not isinstance(straggler, str)  # a malformed --straggler was refused by validate()
        if straggler[0] >= world_size:
            raise collective_error(InputValueError, f"--straggler {self.straggler}: there is no rank "
                                   f"{straggler[0]} in a job of {world_size} ranks; pick one below {world_size}")
        return straggler[1] if straggler[0] == rank else 1.0

    def _model_problem(self) -> Optional[str]:
        """--model's form and the transformer's shape (the data is checked when the model is built)."""
        problem = model_problem(self.model)
        if problem:
            return problem
        for name in ("n_layer", "n_head", "n_embd", "block_size"):
            if getattr(self, name) < 1:
                return f"--{name.replace('_', '-')} must be a positive integer, got {getattr(self, name)}"
        if self.n_embd % self.n_head:
            fits = self.n_embd - self.n_embd % self.n_head or self.n_head
            return (f"--n-embd {self.n_embd} must be a multiple of --n-head {self.n_head} (each head takes "
                    f"n_embd / n_head dimensions), e.g. --n-embd {fits}")
        if self.corpus_bytes < 0:
            return f"--corpus-bytes must be >= 0 (0: the whole corpus), got {self.corpus_bytes}"
        return None

    def gpt(self) -> GPTConfig:
        """The transformer's shape from --n-layer, --n-head, --n-embd, --block-size."""
        return GPTConfig(block_size=self.block_size, n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd)

    def _milestones_problem(self) -> Optional[str]:
        if not self.milestones:
            return "--schedule step needs --milestones, e.g. --milestones 10 20"
        ms = self.milestones
        if any(not 0 < m < self.epochs for m in ms) or any(a >= b for a, b in zip(ms, ms[1:])):
            return (f"--milestones must be increasing epochs between 1 and {self.epochs - 1} "
                    f"(--epochs {self.epochs}), got {' '.join(map(str, ms))}")
        return None

    def warmup(self) -> float:
        """The warm-up length in epochs, with the default filled in."""
        if self.warmup_epochs is None:
            return min(1.0, 0.1 * self.epochs)
        return self.warmup_epochs

    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir or default_cache_dir())


def _add_field(parser: argparse.ArgumentParser, f: dataclasses.Field, kind) -> None:
    flag = "--" + f.name.replace("_", "-")
    meta = dict(f.metadata)
    meta.pop("setting", None)  # a mode's flag: the settings field it sets
    help_text = meta.pop("help") + " (default: %(default)s)"
    if kind is bool:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        return
    scalar = {"Optional[int]": int, "Optional[str]": str, "Optional[float]": float, "List[int]": int}
    base = scalar.get(str(kind).replace("typing.", ""), kind)
    parser.add_argument(flag, type=base, default=f.default, help=help_text, **meta)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that can be silenced (all ranks parse, rank 0 speaks)."""

    def __init__(self, *args, quiet: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.quiet = quiet

    def _print_message(self, message, file=None):
        if not self.quiet:
            super()._print_message(message, file)


def build_parser(quiet: bool = False) -> argparse.ArgumentParser:
    parser = _Parser(
        quiet=quiet,
        prog="python -m hsgd.train",
        description="Data-parallel training with HierarchicalSGD. Launch with "
                    "mpiexec -n N python -m hsgd.train [options] (or srun --mpi=pmi2).")
    hints = get_type_hints(TrainConfig)
    modes = [f for f in dataclasses.fields(TrainConfig) if "setting" in f.metadata]  # ModeFlags'
    for f in dataclasses.fields(TrainConfig):
        if "setting" in f.metadata:
            continue  # after --sync
        _add_field(parser, f, hints[f.name])
        if f.name == "sync":
            for mode_field in modes:
                _add_field(parser, mode_field, hints[mode_field.name])
    return parser


def parse_config(argv=None, quiet: bool = False) -> TrainConfig:
    """Parse the command line into a :class:`TrainConfig` (``--help`` exits here).

    ``quiet=True`` (ranks other than 0) suppresses help and usage messages;
    the exit status is the same on every rank.
    """
    return TrainConfig(**vars(build_parser(quiet).parse_args(argv)))
