"""The trainer's side of the synchronization modes: one config dataclass per mode.

As in torchtitan, each part of a job has its own config, and the trainer's
config composes them: :class:`~hsgd._trainer.config.TrainConfig` keeps the
flat command line (``--inter-node``, ``--gossip-theta``, ...), and
:func:`mode_config` cuts from it the dataclass of the ``--sync`` mode, whose
fields are the mode's keyword arguments. Each field's ``flag`` metadata names
the command-line field it comes from. The library's modes know nothing of the
trainer: they take keyword arguments.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar, Dict, List, Type

from ..modes import SYNC_MODES, SyncMode

__all__ = ["ModeConfig", "MODE_CONFIGS", "mode_config", "mode_flags"]


def _from(flag: str, shared: bool = False):
    """A field taken from ``TrainConfig.<flag>``; ``shared``: a flag of the whole trainer (``--seed``)
    that the mode also reads, never "ignored" by another mode."""
    return field(metadata={"flag": flag, "shared": shared})


@dataclass(frozen=True)
class ModeConfig:
    """The base: the mode's class and its keyword arguments."""

    sync: ClassVar[str] = ""

    @classmethod
    def flags(cls) -> Dict[str, str]:
        """Keyword argument -> the :class:`TrainConfig` field it comes from."""
        return {f.name: f.metadata["flag"] for f in dataclasses.fields(cls)}

    @classmethod
    def from_train(cls, cfg) -> ModeConfig:
        return cls(**{name: getattr(cfg, flag) for name, flag in cls.flags().items()})

    def build(self, optimizer, model, topology, stall=None) -> SyncMode:
        """The mode over ``optimizer`` and ``model``, on ``topology``, sharing the stall
        inspector ``stall`` (``None``: its own). Collective."""
        return SYNC_MODES[self.sync](optimizer, model, topology=topology, stall=stall, **dataclasses.asdict(self))


@dataclass(frozen=True)
class SyncConfig(ModeConfig):
    sync: ClassVar[str] = "sync"
    inter_node: str = _from("inter_node")
    compression: str = _from("compression")
    overlap: bool = _from("overlap")
    bucket_cap_mb: float = _from("bucket_cap_mb")


@dataclass(frozen=True)
class LocalConfig(ModeConfig):
    sync: ClassVar[str] = "local"
    inter_node: str = _from("inter_node")
    compression: str = _from("compression")
    intra_period: int = _from("intra_period")
    inter_period: int = _from("inter_period")


@dataclass(frozen=True)
class DiLoCoConfig(LocalConfig):
    sync: ClassVar[str] = "diloco"
    outer_lr: float = _from("outer_lr")
    outer_momentum: float = _from("outer_momentum")
    outer_nesterov: bool = _from("outer_nesterov")
    fragments: int = _from("fragments")
    fragment_sync_delay: int = _from("fragment_sync_delay")
    fragment_update_alpha: float = _from("fragment_update_alpha")


@dataclass(frozen=True)
class ElasticConfig(ModeConfig):
    sync: ClassVar[str] = "elastic"
    alpha: float = _from("alpha")
    tau: int = _from("tau")


@dataclass(frozen=True)
class AsyncConfig(ModeConfig):
    sync: ClassVar[str] = "async"


@dataclass(frozen=True)
class GossipConfig(ModeConfig):
    sync: ClassVar[str] = "gossip"
    graph: str = _from("gossip_graph")
    theta: float = _from("gossip_theta")
    seed: int = _from("seed", shared=True)


MODE_CONFIGS: Dict[str, Type[ModeConfig]] = {
    c.sync: c for c in (SyncConfig, LocalConfig, DiLoCoConfig, ElasticConfig, AsyncConfig, GossipConfig)}
assert set(MODE_CONFIGS) == set(SYNC_MODES), "every mode has its trainer config"


def mode_config(cfg) -> ModeConfig:
    """The config of ``cfg.sync``'s mode, from the trainer's config."""
    return MODE_CONFIGS[cfg.sync].from_train(cfg)


def mode_flags(sync: str) -> List[str]:
    """The :class:`TrainConfig` fields that belong to mode ``sync`` (not the trainer's own, like ``seed``)."""
    return sorted(f.metadata["flag"] for f in dataclasses.fields(MODE_CONFIGS[sync]) if not f.metadata["shared"])
