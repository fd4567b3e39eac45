"""Each setting is declared once: a mode's ``Settings`` dataclass gives its keyword arguments,
their checks, and the trainer's flags with their help, type, default and choices."""

import argparse
import dataclasses
import inspect
import re

import pytest

from hsgd import InputTypeError, InputValueError
from hsgd._core.settings import Choice, Names, Settings, flag_of
from hsgd._trainer.config import TrainConfig, build_parser, parse_config
from hsgd._trainer.mode_flags import ModeFlags, mode_flag_fields, mode_settings
from hsgd.modes import SYNC_MODES


def test_trainer_config_declares_no_mode_setting_itself():
    """TrainConfig's own source has no field that is a mode's setting: every one comes from ModeFlags."""
    own = re.findall(r"^    (\w+): ", inspect.getsource(TrainConfig), flags=re.MULTILINE)
    flags = {flag_of(f) for mode in SYNC_MODES.values() for f in dataclasses.fields(mode.Settings)}
    shared = {flag_of(f) for mode in SYNC_MODES.values() for f in dataclasses.fields(mode.Settings)
              if f.metadata["shared"]}
    assert shared == {"seed"}  # the trainer's own flag, which gossip reads
    assert not (set(own) & (flags - shared)), set(own) & flags
    assert {f.name for f in dataclasses.fields(ModeFlags)} <= {f.name for f in dataclasses.fields(TrainConfig)}


def test_every_setting_is_one_flag_with_its_fields_help_default_and_choices():
    actions = {a.dest: a for a in build_parser(quiet=True)._actions}
    seen = {}
    for sync, mode in SYNC_MODES.items():
        assert issubclass(mode.Settings, Settings) and dataclasses.is_dataclass(mode.Settings)
        for f in dataclasses.fields(mode.Settings):
            flag = flag_of(f)
            if flag is None or f.metadata["shared"]:
                continue
            assert seen.setdefault(flag, f) is f, f"--{flag} declared twice ({sync})"  # one field, one flag
            action = actions[flag]
            assert action.help.startswith(f.metadata["help"] + " (--sync "), action.help
            assert action.default == f.default
            check = f.metadata["check"]
            assert action.choices == (list(check.options) if isinstance(check, Choice) else None)
            if isinstance(f.default, bool):
                assert isinstance(action, argparse.BooleanOptionalAction)
            else:
                assert action.type is type(f.default)
    assert set(seen) == {flag_of(f) for f in mode_flag_fields()}
    assert {"inter_node", "compression"} <= set(seen)  # shared by three modes, declared once


def test_a_modes_flags_build_its_settings():
    cfg = parse_config(["--sync", "gossip", "--gossip-theta", "0.5", "--gossip-graph", "ring", "--seed", "3"])
    assert mode_settings(cfg) == SYNC_MODES["gossip"].Settings(graph="ring", theta=0.5, seed=3)
    cfg = parse_config(["--sync", "local", "--fragments", "2", "--intra-period", "4"])
    local = mode_settings(cfg)
    assert local.intra_period == 4 and local.fragments == 1  # --fragments is diloco's: ignored, reported
    assert cfg.ignored_flags() == ["--fragments"]


def test_keywords_are_the_settings_fields():
    for mode in SYNC_MODES.values():
        params = inspect.signature(mode).parameters
        for f in dataclasses.fields(mode.Settings):
            assert params[f.name].kind is inspect.Parameter.KEYWORD_ONLY and params[f.name].default == f.default
        if dataclasses.fields(mode.Settings):
            assert all(f"``{f.name}``" in mode.Settings.__doc__ for f in dataclasses.fields(mode.Settings))


def test_settings_check_themselves_and_name_the_keyword_or_the_flag():
    local = SYNC_MODES["local"].Settings
    with pytest.raises(InputValueError, match="Invalid intra_period: 0"):
        local(intra_period=0).validate()
    with pytest.raises(InputValueError, match="Invalid --intra-period: 0"):
        local(intra_period=0).validate(Names({"intra_period": "intra_period"}))
    with pytest.raises(InputValueError, match="fragment_sync_delay=4 must be below"):
        SYNC_MODES["diloco"].Settings(intra_period=2, inter_period=2, fragment_sync_delay=4).validate()
    with pytest.raises(InputTypeError, match="has no setting 'intra_perod'; its settings: inter_node"):
        local.build({"intra_perod": 2}, "HierarchicalLocalSGD")
    SYNC_MODES["sync"].Settings(compression=None).validate()  # None: no compression, as "none"


def test_a_mode_takes_its_settings_as_one_object_or_as_keywords():
    import torch

    from hsgd import HierarchicalLocalSGD, HierarchicalSGD

    model = torch.nn.Linear(4, 2)
    settings = HierarchicalLocalSGD.Settings(intra_period=2, inter_period=2)
    with HierarchicalLocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, settings=settings) as opt:
        assert opt.settings is settings and opt.averaging_level(2) == "node"
    with pytest.raises(InputTypeError, match="not both"):
        HierarchicalLocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, settings=settings, intra_period=2)
    with pytest.raises(InputTypeError, match="HierarchicalLocalSGD.Settings"):
        HierarchicalLocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, settings=HierarchicalSGD.Settings())
