"""End to end: --model gpt on token data and --model package.module:factory, under mpiexec.

Tiny models and corpora: each job runs a few dozen steps on 2 ranks.
"""

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import pytest
from mpirun import ROOT, run_mpi

from hsgd._io.tokens import write_tokens

# one 1-layer transformer of width 32 over 32-byte contexts
GPT = ["--model", "gpt", "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
       "--lr", "0.003", "--progress", "lines"]

ZOO = '''
import torch
from torch import nn


def mlp(sample_shape, num_classes):
    """Classification: (B, *sample_shape) float32 -> (B, num_classes)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(sample_shape[-1], 32), nn.ReLU(), nn.Linear(32, num_classes))


class Bigram(nn.Module):
    """Language modelling: (B, T) int64 tokens -> (B, T, vocabulary) logits."""

    def __init__(self, vocabulary):
        super().__init__()
        self.table = nn.Embedding(vocabulary, vocabulary)
        nn.init.zeros_(self.table.weight)  # a uniform guess to start with: 8 bits per byte

    def forward(self, tokens):
        return self.table(tokens)


def bigram(sample_shape, num_classes):
    return Bigram(num_classes)


def raises(sample_shape, num_classes):
    raise RuntimeError(f"no model for samples of shape {sample_shape}")
'''


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """A directory holding the factory module ``userzoo``, for PYTHONPATH."""
    directory = tmp_path_factory.mktemp("zoo")
    (directory / "userzoo.py").write_text(textwrap.dedent(ZOO))
    return directory


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """What ``python -m hsgd.data text`` writes of two files of this repository, in blocks of 64
    bytes (written in this process: the command would start MPI, whose Open MPI singleton leaves a
    segment in /dev/shm)."""
    path = tmp_path_factory.mktemp("tokens") / "tokens.h5"
    return str(write_tokens(path, [str(ROOT / "hsgd/_trainer/gpt.py"), str(ROOT / "hsgd/_io/tokens.py")],
                            block_size=64))


def train(args, cache, zoo=None, timeout=240):
    env = None if zoo is None else {"PYTHONPATH": os.pathsep.join(filter(None, [str(zoo),
                                                                              os.environ.get("PYTHONPATH")]))}
    return run_mpi(2, ["-m", "hsgd.train", "--cache-dir", cache, *args], timeout=timeout, env=env)


def epochs(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == "epoch"]


def test_gpt_trains_on_the_standard_library_and_reports_bits_per_byte(tmp_path, cache):
    run = tmp_path / "run"
    proc = train([*GPT, "--corpus-bytes", "30000", "--batch-size", "32", "--epochs", "2", "--run-dir", str(run)],
                 cache)
    assert proc.returncode == 0, proc.stderr
    assert "standard library's sources" in proc.stderr and "vocabulary 256, context 32" in proc.stderr
    records = epochs(run)
    assert [e["epoch"] for e in records] == [0, 1]
    for e in records:
        assert e["test_bpb"] == pytest.approx(e["test_loss"] / math.log(2))
        assert e["train_bpb"] == pytest.approx(e["train_loss"] / math.log(2))
    assert records[-1]["test_bpb"] < 7.0  # a uniform guess over 256 bytes costs 8 bits
    (data,) = Path(cache).glob("stdlib-py*_block32_bytes30000_*.h5")
    with h5py.File(data, "r") as f:
        assert f.attrs["kind"] == "tokens" and f.attrs["source"] == "stdlib" and len(f.attrs["sha256"]) == 64
        assert f.attrs["corpus_bytes"] == 30000 and len(f["files"]) == f.attrs["num_files"] > 0
    report = subprocess.run([sys.executable, "-m", "hsgd.report", str(run), "--no-plots"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert "| test bpb |" in report.stdout and "best test bpb: " in report.stdout, report.stdout


def test_gpt_cuts_longer_blocks_into_its_contexts(tmp_path, cache, tokens):
    run = tmp_path / "run"
    proc = train([*GPT, "--data", tokens, "--batch-size", "16", "--epochs", "1", "--run-dir", str(run)], cache)
    assert proc.returncode == 0, proc.stderr
    assert "samples of shape (64,), vocabulary 256, context 32" in proc.stderr
    assert epochs(run)[-1]["test_bpb"] < 8.0


def test_your_own_model_classifies(tmp_path, cache, zoo):
    run = tmp_path / "run"
    proc = train(["--model", "userzoo:mlp", "--mnist1d-samples", "1000", "--batch-size", "64", "--epochs", "2",
                  "--run-dir", str(run)], cache, zoo)
    assert proc.returncode == 0, proc.stderr
    assert "10 classes; userzoo:mlp adamw" in proc.stderr
    record = epochs(run)[-1]
    assert record["test_acc"] > 0.15 and "test_bpb" not in record  # chance: 0.1


def test_your_own_model_on_token_data_models_language(tmp_path, cache, zoo, tokens):
    run = tmp_path / "run"
    proc = train(["--model", "userzoo:bigram", "--data", tokens, "--batch-size", "16", "--epochs", "2",
                  "--lr", "0.05", "--run-dir", str(run)], cache, zoo)
    assert proc.returncode == 0, proc.stderr
    assert "vocabulary 256; userzoo:bigram" in proc.stderr  # the whole block: no context given
    records = epochs(run)
    assert records[-1]["test_bpb"] < records[0]["test_bpb"] < 8.0


@pytest.mark.parametrize("args,text", [
    (["--model", "nosuchpkg_xyz.models:build"], "there is no module 'nosuchpkg_xyz' to import"),
    (["--model", "userzoo:raises"], "raised RuntimeError: no model for samples of shape (40,)"),
    ([*GPT, "--block-size", "128", "--data", "TOKENS"], "--block-size 128 is longer than the data's blocks of 64"),
])
def test_bad_model_exits_2_with_one_error_line(tmp_path, cache, zoo, tokens, args, text):
    args = [tokens if a == "TOKENS" else a for a in args]
    proc = train(["--mnist1d-samples", "200", "--batch-size", "32", *args, "--run-dir", str(tmp_path / "run")],
                 cache, zoo, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 2 and len(errors) == 1 and text in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
