"""The trainer's side of the synchronization modes: their flags, derived from their settings.

Each mode declares its settings once, as the frozen dataclass ``Settings``
(:mod:`hsgd._core.settings`); every field that names a flag is one trainer
option, with the field's default, type, choices and help (plus the ``--sync``
modes that take it) and the field's check. A setting several modes share
(``--inter-node``, ``--compression``) is one field of their family's settings,
so one flag; a field marked ``shared`` reads a flag of the trainer's own
(``--seed``). :data:`ModeFlags` is the dataclass of these flags, which
:class:`~hsgd._trainer.config.TrainConfig` extends; :func:`mode_settings`
cuts the ``--sync`` mode's settings from the config and :func:`build_mode`
builds the mode.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Type

from .._core.settings import Choice, Names, Settings, fields_of, flag_of
from ..compression import codec_of
from ..errors import InputError
from ..modes import SYNC_MODES, SyncMode

__all__ = ["ModeFlags", "mode_settings", "build_mode", "mode_flags", "mode_flag_fields", "mode_problem"]


def _settings_class(sync: str) -> Type[Settings]:
    return SYNC_MODES[sync].Settings


def _taken(sync: str) -> List[dataclasses.Field]:
    """The fields of mode ``sync``'s settings that the trainer sets from its own flags."""
    cls = _settings_class(sync)
    return [f for f in dataclasses.fields(cls) if flag_of(f) is not None and f.name not in cls.flags_off]


def mode_flag_fields() -> List[dataclasses.Field]:
    """Every mode's settings fields that are flags of their own (not the trainer's, like ``--seed``),
    each once, in the order of ``SYNC_MODES`` and of the fields."""
    return [f for f in fields_of(_settings_class(sync) for sync in SYNC_MODES)
            if flag_of(f) is not None and not f.metadata["shared"]]


def _help(f: dataclasses.Field) -> str:
    flag = flag_of(f)
    modes = [sync for sync in SYNC_MODES if any(flag_of(g) == flag for g in _taken(sync))]
    return f"{f.metadata['help']} (--sync {' | '.join(modes)})"


def _flag_field(f: dataclasses.Field):
    check = f.metadata["check"]
    meta: Dict[str, Any] = {"help": _help(f), "setting": f.name}
    if isinstance(check, Choice):
        meta["choices"] = list(check.options)
    return flag_of(f), type(f.default), dataclasses.field(default=f.default, metadata=meta)


#: The trainer's config fields of the modes' settings (``--intra-period``, ``--gossip-theta``, ...),
#: each derived from the one settings field that declares it.
ModeFlags: Any = dataclasses.make_dataclass("ModeFlags", [_flag_field(f) for f in mode_flag_fields()])


def _names() -> Names:
    """Fields named as the trainer's flags."""
    return Names({f.name: flag for sync in SYNC_MODES for f in dataclasses.fields(_settings_class(sync))
                  if (flag := flag_of(f)) is not None})


def mode_flags(sync: str) -> List[str]:
    """The config fields (flags) that mode ``sync`` takes, not the trainer's own (``seed``)."""
    return sorted(str(flag_of(f)) for f in _taken(sync) if not f.metadata["shared"])


def mode_settings(cfg) -> Settings:
    """The ``--sync`` mode's settings, from the trainer's config (not checked)."""
    return _settings_class(cfg.sync)(**{f.name: getattr(cfg, str(flag_of(f))) for f in _taken(cfg.sync)})


def mode_problem(cfg) -> Optional[str]:
    """The first bad mode flag, as an instruction naming it: every flag's own check whatever
    ``--sync`` is, then the ``--sync`` mode's checks across its settings, then a compression
    with error feedback given to a mode without sums across nodes to compress, or an outer
    compression to a mode without pseudo-gradients (refused, not ignored as other modes'
    flags are: the user would believe the wire compressed); ``None`` if fine."""
    names = _names()
    try:
        for f in mode_flag_fields():
            check = f.metadata["check"]
            if check is not None:
                check(names(f.name), getattr(cfg, str(flag_of(f))))
        mode_settings(cfg).validate(names)
    except InputError as exc:
        return str(exc)
    codec = codec_of(cfg.compression, cfg.powersgd_rank)
    if codec is not None and codec.feedback and "compression" not in mode_flags(cfg.sync):
        takers = [sync for sync in SYNC_MODES if "compression" in mode_flags(sync) and _takes(sync, cfg)]
        return (f"--compression {cfg.compression} compresses the gradient sums across nodes, with error feedback; "
                f"--sync {cfg.sync} has none: use --sync {' | '.join(takers)}")
    if cfg.outer_compression != "none" and "outer_compression" not in mode_flags(cfg.sync):
        takers = [sync for sync in SYNC_MODES if "outer_compression" in mode_flags(sync)]
        return (f"--outer-compression {cfg.outer_compression} compresses DiLoCo's pseudo-gradients; --sync "
                f"{cfg.sync} has none: use --sync {' | '.join(takers)}, or --compression for the gradient sums")
    return None


def _takes(sync: str, cfg) -> bool:
    """Whether mode ``sync`` takes the flags of ``cfg`` (as if ``--sync sync`` were given)."""
    try:
        _settings_class(sync)(**{f.name: getattr(cfg, str(flag_of(f))) for f in _taken(sync)}).validate()
    except InputError:
        return False
    return True


def build_mode(cfg, optimizer, model, topology, stall=None) -> SyncMode:
    """The ``--sync`` mode over ``optimizer`` and ``model``, on ``topology``, sharing the stall
    inspector ``stall`` (``None``: its own). Collective."""
    return SYNC_MODES[cfg.sync](optimizer, model, topology=topology, stall=stall, settings=mode_settings(cfg))
