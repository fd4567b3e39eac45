"""The trainer's command line: every bad flag gets one instruction naming the flag."""

import pytest

from hsgd import InputValueError
from hsgd.train import parse_config


@pytest.mark.parametrize("argv,flag", [
    (["--optimizer", "lars", "--trust-coefficient", "0"], "--trust-coefficient"),
    (["--optimizer", "lars", "--trust-coefficient", "-0.001"], "--trust-coefficient"),
    (["--optimizer", "sgd", "--nesterov", "--momentum", "0"], "--nesterov"),
    (["--optimizer", "lars", "--nesterov", "--momentum", "0"], "--nesterov"),
    (["--momentum", "1.5"], "--momentum"),
    (["--momentum", "1"], "--momentum"),
    (["--momentum", "-0.1"], "--momentum"),
    (["--schedule", "step", "--milestones", "0"], "--milestones"),
    (["--schedule", "step", "--epochs", "10", "--milestones", "10"], "--milestones"),
    (["--schedule", "step", "--milestones", "8", "4"], "--milestones"),
    (["--schedule", "step"], "--milestones"),
    (["--lr", "0"], "--lr"),
    (["--epochs", "-1"], "--epochs"),
    (["--sync", "gossip", "--balance"], "--balance needs a mode"),
    (["--intra-period", "0"], "--intra-period"),
    (["--sync", "diloco", "--outer-lr", "0"], "--outer-lr"),
    (["--sync", "diloco", "--outer-momentum", "1"], "--outer-momentum"),
    (["--sync", "diloco", "--outer-momentum", "0"], "--outer-nesterov needs"),
    (["--sync", "diloco", "--fragments", "0"], "--fragments"),
    (["--sync", "diloco", "--intra-period", "2", "--inter-period", "2", "--fragment-sync-delay", "4"],
     "--fragment-sync-delay"),
    (["--sync", "diloco", "--fragment-update-alpha", "1.5"], "--fragment-update-alpha"),
    (["--gossip-theta=-0.5"], "--gossip-theta"),
    (["--gossip-theta", "nan"], "--gossip-theta"),
    (["--straggler", "3"], "--straggler"),
    (["--straggler", "a:3"], "--straggler"),
    (["--straggler=-1:3"], "--straggler"),
    (["--straggler", "1:0.5"], "--straggler"),
    (["--straggler", "1:inf"], "--straggler"),
    (["--straggler", "1:nan"], "--straggler"),
    (["--overlap", "--bucket-cap-mb", "0"], "--bucket-cap-mb"),
    (["--bucket-cap-mb", "nan"], "--bucket-cap-mb"),
    (["--width", "0"], "--width"),
    (["--model", "transformer"], "--model 'transformer' is not a built-in model"),
    (["--model", "mypkg.models:"], "--model 'mypkg.models:': give your own model as package.module:factory"),
    (["--model", "my-pkg:build"], "package.module:factory"),
    (["--model", "gpt", "--n-layer", "0"], "--n-layer must be a positive integer"),
    (["--model", "gpt", "--n-head", "0"], "--n-head must be a positive integer"),
    (["--model", "gpt", "--n-embd", "-8"], "--n-embd must be a positive integer"),
    (["--model", "gpt", "--block-size", "0"], "--block-size must be a positive integer"),
    (["--model", "gpt", "--n-embd", "100", "--n-head", "3"], "--n-embd 100 must be a multiple of --n-head 3"),
    (["--model", "gpt", "--corpus-bytes", "-1"], "--corpus-bytes must be >= 0"),
    (["--clip-grad-norm", "-1"], "--clip-grad-norm must be a finite number >= 0"),
    (["--clip-grad-norm", "nan"], "--clip-grad-norm must be a finite number >= 0"),
    (["--clip-grad-norm", "inf"], "--clip-grad-norm must be a finite number >= 0"),
])
def test_bad_flags_are_named(argv, flag):
    problem = parse_config(argv).validate()
    assert problem is not None and flag in problem, problem


@pytest.mark.parametrize("argv", [
    [],
    ["--optimizer", "sgd", "--nesterov", "--momentum", "0.9"],
    ["--optimizer", "adamw", "--momentum", "0"],
    ["--schedule", "step", "--epochs", "30", "--milestones", "10", "20"],
    ["--optimizer", "lars", "--trust-coefficient", "0.02"],
    ["--straggler", "3:3"],
    ["--straggler", "0:1"],
    ["--sync", "gossip", "--gossip-theta", "inf", "--gossip-graph", "ring"],
    ["--model", "mlp", "--width", "1000"],
    ["--model", "gpt", "--n-embd", "96", "--n-head", "3", "--block-size", "64", "--corpus-bytes", "100000"],
    ["--model", "mypkg.models:build"],
    ["--model", "mypkg.models:Zoo.small"],
])
def test_good_flags_pass(argv):
    assert parse_config(argv).validate() is None


@pytest.mark.parametrize("argv,ignored", [
    (["--intra-period", "2"], ["--intra-period"]),
    (["--sync", "sync", "--intra-period", "2", "--inter-period", "3"], ["--inter-period", "--intra-period"]),
    (["--sync", "local", "--intra-period", "2"], []),
    (["--sync", "local", "--fragments", "2", "--outer-lr", "0.5"], ["--fragments", "--outer-lr"]),
    (["--sync", "diloco", "--fragments", "2", "--intra-period", "2"], []),
    (["--sync", "local", "--overlap"], ["--overlap"]),
    (["--overlap", "--bucket-cap-mb", "5"], []),
    ([], []),
])
def test_flags_of_another_mode_are_reported_as_ignored(argv, ignored):
    assert parse_config(argv).ignored_flags() == ignored


def test_straggler_slows_only_its_rank_and_must_be_in_the_job():
    cfg = parse_config(["--straggler", "2:2.5"])
    assert [cfg.straggler_factor(rank, 4) for rank in range(4)] == [1.0, 1.0, 2.5, 1.0]
    assert parse_config([]).straggler_factor(0, 1) == 1.0
    with pytest.raises(InputValueError, match="no rank 2 in a job of 2 ranks") as err:
        cfg.straggler_factor(0, 2)
    assert err.value.hsgd_agreed  # every rank decides alike: the trainer exits with one message


def test_amp_fp16_with_overlap_is_refused_where_overlap_applies():
    problem = parse_config(["--overlap", "--amp", "fp16"]).validate()
    assert problem is not None and "--overlap" in problem and "--amp bf16" in problem, problem
    for argv in (["--overlap", "--amp", "bf16"], ["--amp", "fp16"], ["--sync", "local", "--overlap", "--amp", "fp16"]):
        assert parse_config(argv).validate() is None, argv  # bf16 has no GradScaler; local ignores --overlap


@pytest.mark.parametrize("name,shape,width,params", [
    ("mlp", (40,), None, 40 * 100 + 100 + 100 * 100 + 100 + 100 * 10 + 10),
    ("mlp", (40,), 1000, 40 * 1000 + 1000 + 1000 * 1000 + 1000 + 1000 * 10 + 10),
    ("cnn", (40,), 8, 8 * 5 + 8 + 2 * (8 * 8 * 3 + 8) + 8 * 5 * 10 + 10),
])
def test_width_sets_the_models_size(name, shape, width, params):
    from hsgd._trainer.models import build_model

    model = build_model(name, shape, 10, width)
    assert sum(p.numel() for p in model.parameters()) == params


def test_resnet_width_scales_its_stages():
    from hsgd._trainer.models import build_model

    model = build_model("resnet", (3, 8, 8), 10, width=4)
    assert [b.conv2.out_channels for b in model.blocks] == [4, 8, 16]
