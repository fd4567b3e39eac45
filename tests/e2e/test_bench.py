"""End to end: every ``python -m hsgd.bench`` and ``python -m lab.bench`` subcommand at a tiny size, and its errors.

``hsgd.bench`` (in the wheel) runs ``allreduce`` and ``train``; the lab beside the package
(``lab.bench``, from the checkout) runs the rest. Each smoke test runs one subcommand as a
user would (it launches its own ``mpiexec`` jobs), with 1-2 ranks, tiny sizes and 1-2 repeats, and checks
that it ends with status 0, prints its table's header, reports progress on
stderr, and writes JSON that parses and holds the raw measurements, one per
repeat. Nothing here asserts on a timing. A bad option must give one
``error:`` line and status 2 before anything runs.
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from mpirun import ROOT, run_command

from hsgd.bench import SUBCOMMANDS
from lab.bench import SUBCOMMANDS as LAB_SUBCOMMANDS
from lab.bench.__main__ import main as lab_main
from lab.bench._race_worker import METHODS as RACE_METHODS
from lab.hosts import missing_capability

IN_CI = os.environ.get("CI", "").strip().lower() == "true"

# Where each subcommand runs: the package's own (allreduce, train), else the lab's.
PACKAGE = {name: "hsgd.bench" if name in SUBCOMMANDS else "lab.bench" for name in LAB_SUBCOMMANDS}

TRAIN = ["--mnist1d-samples", "2000", "--batch-size", "64"]  # passed on to hsgd.train


# name: (options, the table's header, raw -> the lists of repeated measurements, repeats);
# "{cache}" stands for the module's MNIST-1D cache directory.
SMOKE = {
    "allreduce": (["--ranks", "2", "--sizes", "1e3", "--repeats", "2", "--warmup", "1"],
                  "| ranks | floats | hsgd ms | hsgd 2-level ms | MPI ms | gloo ms | MPI/hsgd | gloo/hsgd "
                  "| copy ms | add ms |",
                  lambda raw: [*raw[0]["times"].values(), raw[0]["copy"], raw[0]["add"]], 2),
    "staging": (["--device", "cpu", "--ranks", "2", "--workloads", "mlp2m", "--repeats", "2", "--warmup", "1"],
                "| device | ranks | workload | MB | tensors | gather ms | scatter ms | staging ms | floor pageable ms "
                "| floor pinned ms | staging / pageable floor | staging / pinned floor | D2H pageable GB/s "
                "| H2D pageable GB/s | D2H pinned GB/s | H2D pinned GB/s |",
                lambda raw: list(raw[0]["times"].values()), 2),
    "io": (["--gib", "0.001", "--ranks", "2", "--repeats", "1", "--bounded-seconds", "0.2", "--batch-size", "16"],
           "| data | ranks | cache | loader | DataLoader* | fancy* | raw | loader/DataLoader | loader/fancy "
           "| loader/raw |",
           lambda raw: [r["rates"] for r in raw], 1),
    "box": (["--ranks", "2", "--sizes", "1e3", "--repeats", "2", "--seconds", "0.1"],
            "| ranks | floats | PS | box | box, all work | box, owner computes | box/PS | all work/PS "
            "| owner computes/PS |",
            lambda raw: list(raw[0]["rates"].values()), 2),
    "stall": (["--ranks", "2", "--params", "1000", "--steps", "3", "--repeats", "2", "--warmup", "1"],
              "| stall inspector | ms per step (each repeat) | median | on / off |",
              lambda raw: list(raw["seconds_per_step"].values()), 2),
    "modes": (["--ranks", "2", "--part", "accuracy", "--modes", "sync", "--epochs", "1", "--warmup", "0",
               "--cache-dir", "{cache}", *TRAIN],
              "| --sync | final test acc | best test acc | wall s |",
              lambda raw: [[r["seconds"] for r in raw["accuracy"]]], 1),
    "gossip": (["--ranks", "2", "--epochs", "1", "--thetas", "--warmup", "0", "--cache-dir", "{cache}",
                *TRAIN],
               "| run | intra MB | inter MB | traffic vs every-step gossip | wall s | train s "
               "| train time vs every-step gossip | final test acc | best test acc |",
               lambda raw: [[r["seconds"]] for r in raw], 1),
    "lars": (["--ranks", "2", "--epochs", "2", "--samples", "2000", "--runs", "sgd-256", "--cache-dir", "{cache}"],
             "| run | epochs | steps | final test acc | best test acc | final train loss | wall s |",
             lambda raw: [[r["seconds"] for r in raw]], 1),
    "diloco": (["--ranks", "2", "--ranks-per-node", "1", "--period", "4", "--fragments", "2", "--epochs", "1",
                "--warmup", "0", "--cache-dir", "{cache}", "--n-layer", "1", "--n-head", "2", "--n-embd", "32",
                "--block-size", "32", "--corpus-bytes", "100000"],
               "| run | steps | val loss | vs sync | bits/byte | inter-node MB | sync / this "
               "| peak MB per step (rank 0) | wall s |",
               lambda raw: [[r["seconds"]] for r in raw], 1),
    "faults": (["--ranks", "2", "--rows", "raise"],
               "| fault | injected | exit | what the job said | s to end | left behind | test |",
               lambda raw: [[r["seconds"] for r in raw]], 1),
    "saves": (["--ranks", "1", "--every", "0", "5", "--repeats", "1", "--warmup", "0", "--skip", "2", "--width", "64",
               "--cache-dir", "{cache}", *TRAIN],
              "| --save-every | ms per step | vs none | saves per run | ms per save (step's gather) "
              "| ms per save (background write) |",
              lambda raw: [[r["step_s"] for r in raw if r["every"] == every] for every in (0, 5)], 1),
    "restart": (["--hosts", "2", "--ranks-per-host", "1", "--probe-timeout", "2", "--cache-dir", "{cache}",
                 "--epochs", "2", "--save-every", "5", *TRAIN],
                "| fault | host | at step | from checkpoint | detection s | old job's end s | probe s "
                "| new job's start-up s | loading s | steps redone s | lost s | target s | met | final test acc % "
                "| without fault % |",
                lambda raw: [[r["lost"] for r in raw]], 1),
    "model": (["--validate", "--validate-sizes", "64", "--params", "1e3", "--nodes", "1", "4", "--ranks-per-node",
               "1", "2", "--repeats", "2", "--warmup", "0"],
              "| params | nodes | ranks/node | ranks | flat ring ms | leader ms | sharded ms | gossip ms | box ms "
              "| fastest sync |",
              lambda raw: [*raw["calibration"]["level1"], *raw["calibration"]["mpi"],
                           *(t for row in raw["validation"] for t in row["times"].values())], 2),
    "race": (["--ranks", "2", "--ranks-per-node", "1", "--steps", "4", "--eval-every", "2", "--width", "64",
              "--start-step", "2", "--powersgd-rank", "4", "--samples", "2000", "--target", "0.05",
              "--cache-dir", "{cache}"],
             "| method | steps to target | s to target | DDP's s / this | s per step | MB per step, busiest link "
             "| bytes vs hsgd fp32 | link s per step | final test acc | vs hsgd fp32 (points) |",
             lambda raw: [[r["evals"][-1][1] for r in raw if r["method"] == m] for m in RACE_METHODS], 1),
    "train": (["--ranks", "2", "--workloads", "cnn", "--steps", "1", "--repeats", "2", "--warmup", "0",
               "--cnn-batch", "8"],
              "| ranks | batch/rank | no comm | hsgd | hsgd overlap | hsgd leader 2n | hsgd sharded 2n "
              "| hsgd overlap sharded 2n | DDP | DDP bucket view | hsgd.horovod | hsgd.horovod overlap | Horovod "
              "| hsgd samples/s | DDP/hsgd | DDP bucket view/hsgd | hsgd/hsgd overlap | hsgd.horovod/hsgd "
              "| hsgd.horovod overlap/hsgd overlap |",
              lambda raw: [*raw[0]["times"].values(), raw[0]["average"]], 2),
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One generated MNIST-1D file for the training benchmarks."""
    return str(tmp_path_factory.mktemp("cache"))


def bench(name, *args, timeout=180):
    return run_command([sys.executable, "-m", PACKAGE[name], name, *args], timeout=timeout)


def test_every_subcommand_has_a_smoke_test():
    assert set(SUBCOMMANDS) <= set(LAB_SUBCOMMANDS)  # the lab runs the package's too, and across hosts
    assert sorted(SMOKE) == sorted(LAB_SUBCOMMANDS)


def test_the_package_runs_what_a_user_measures_on_their_cluster():
    """``python -m hsgd.bench --help`` lists allreduce, train and staging; the lab's subcommands are not there."""
    proc = subprocess.run([sys.executable, "-m", "hsgd.bench", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    listed = [line.split()[0] for line in proc.stdout.splitlines() if line.startswith("    ") and line.split()
              and not line.startswith("     ")]
    assert list(SUBCOMMANDS) == ["allreduce", "train", "staging"] and listed == list(SUBCOMMANDS), proc.stdout
    lab = subprocess.run([sys.executable, "-m", "lab.bench", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert lab.returncode == 0, lab.stderr
    assert [line.split()[0] for line in lab.stdout.splitlines() if line.startswith("    ") and line.split()
            and not line.startswith("     ")] == list(LAB_SUBCOMMANDS), lab.stdout


@pytest.mark.parametrize("name", list(SMOKE))
def test_subcommand_runs_prints_its_table_and_writes_raw_json(name, tmp_path, cache, capsys):
    options, header, repeated, repeats = SMOKE[name]
    if name == "restart" and missing_capability() and not IN_CI:  # its hosts are emulated: root only
        pytest.skip(f"emulated hosts: {missing_capability()}")
    out = tmp_path / "out.json"
    proc = bench(name, *(o.format(cache=cache) for o in options), "--json", str(out), "--progress", "lines")
    assert proc.returncode == 0, proc.stderr
    assert header in proc.stdout.splitlines(), proc.stdout
    assert f"{PACKAGE[name]} {name} [1/" in proc.stderr  # progress lines
    record = json.loads(out.read_text())
    assert record["subcommand"] == name and record["command"].startswith(f"python -m {PACKAGE[name]} {name} ")
    assert header == "| " + " | ".join(record["tables"][0]["columns"]) + " |"
    assert record["tables"][0]["rows"] and record["environment"]["cpus"] >= 1
    measured = repeated(record["raw"])
    assert measured and all(len(m) == repeats and all(isinstance(v, float) for v in m) for m in measured), measured
    if name == "diloco":  # equal steps; local SGD and DiLoCo cross nodes every 4th step, streaming half as much
        rows = {r["run"]: r for r in record["raw"]}
        assert len({r["steps"] for r in rows.values()}) == 1, rows
        assert rows["local 4"]["inter_bytes"] < rows["sync"]["inter_bytes"] / 3, rows
        assert rows["streaming 4/2"]["peak_step_bytes"] < 0.6 * rows["diloco 4"]["peak_step_bytes"], rows
    if name == "race":  # every method ran the same steps; hsgd int8 sent about a quarter of fp32's bytes
        assert {r["method"] for r in record["raw"]} == set(RACE_METHODS) and all(len(r["evals"]) == 2
                                                                              for r in record["raw"])
        sent = {r["method"]: r["inter_bytes"] for r in record["raw"]}
        assert 0.25 < sent["hsgd int8"] / sent["hsgd fp32"] < 0.35 and sent["hsgd powersgd"] < sent["hsgd fp32"], sent
        # --join (in this process: no launch): two runs' rows in one table; runs of other settings refused
        other = tmp_path / "other.json"
        other.write_text(json.dumps({**record, "settings": {**record["settings"], "steps": 5}}))
        slower = tmp_path / "slower.json"  # the same run, every step 1000 times as long
        slower.write_text(json.dumps({**record, "raw": [{**r, "evals": [[s, 1000 * t, a] for s, t, a in r["evals"]]}
                                                        for r in record["raw"]]}))
        assert lab_main(["race", "--join", str(out), str(slower)]) == 0
        joined = capsys.readouterr().out  # s per step: the median of the 2 repeats, and their range
        cells = re.findall(r"\| (\d+\.\d{3}) \((\d+\.\d{3})-(\d+\.\d{3})\) \|", joined)
        assert "median of 2 (smallest-largest" in joined and len(cells) == len(RACE_METHODS), joined
        assert all(float(low) < float(mid) < float(high) for mid, low, high in cells), cells
        with pytest.raises(SystemExit):
            lab_main(["race", "--join", str(out), str(other)])
        assert "the runs differ in steps" in capsys.readouterr().err
    if name == "restart":  # one host lost, the run restarted on the other; the parts add up to the seconds lost
        (row,) = record["raw"]
        parts = ("detect", "end", "probe", "startup", "load", "redo")
        assert row["world"] == 1 and abs(sum(row[p] for p in parts) - row["lost"]) < 0.5, row
    if name == "faults":  # the row says what happened, and the job left nothing behind
        (row,) = record["raw"]
        assert row["exit"] != 0 and "a bug on rank 1" in row["said"] and row["left"] == [], row
    if name == "train":  # every method ran, side by side in one job
        (row,) = record["raw"]
        want = {"no comm", "hsgd", "hsgd overlap", "hsgd leader 2n", "hsgd sharded 2n", "hsgd overlap sharded 2n",
                "DDP", "DDP bucket view", "hsgd.horovod", "hsgd.horovod overlap", "hsgd local",
                "torch periodic", "hsgd local 2n", "torch hierarchical"}
        assert want <= set(row["times"]), row["times"].keys()
        assert ("Horovod" in row["times"]) != any("Horovod: skipped" in n for n in row["skipped"]), row["skipped"]
    if name == "model":  # 4 configurations, 3 strategies each, and hsgd counted the bytes the model counts
        rows = record["tables"][2]["rows"]
        assert len(rows) == 12 and all(r[-1] in ("yes", "-") for r in rows), rows


def test_model_predicts_without_measuring_and_draws(tmp_path):
    """With this machine's figures given, ``model`` launches nothing: a table, JSON and a PNG."""
    out, png = tmp_path / "model.json", tmp_path / "model.png"
    proc = bench("model", "--params", "1e6", "5210", "--nodes", "1", "4", "4096", "--ranks-per-node", "1", "128",
                 "--intra-latency", "1e-6", "--intra-bandwidth", "5e9", "--local-latency", "1e-6",
                 "--local-bandwidth", "5e9", "--png", str(png), "--json", str(out), "--progress", "lines")
    assert proc.returncode == 0, proc.stderr
    assert SMOKE["model"][1] in proc.stdout.splitlines(), proc.stdout
    assert "ranks measured" not in proc.stderr  # no MPI job
    record = json.loads(out.read_text())
    assert record["raw"]["calibration"] is None and len(record["raw"]["predictions"]) == 2 * 3 * 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.parametrize("args, message", [
    (["allreduce", "--repeats", "0"], "argument --repeats: 0 is too small: use at least 1"),
    (["box", "--ranks", "1"], "argument --ranks: 1 is too small: use at least 2 (a server and a worker)"),
    (["box", "--bogus", "1"], "unrecognized arguments: --bogus 1"),
    (["io", "--json", "/nonexistent-dir/x.json"], "argument --json: the directory /nonexistent-dir does not exist"),
    (["io", "--gib", "0.0001", "--ranks", "2"], "argument --gib: a 3x32x32 f32 file of 0.0001 GiB holds 8 samples"),
    (["lars", "--runs", "sgd-512"], "argument --runs: invalid choice: 'sgd-512'"),
    (["lars", "--epochs-4096", "5", "--lars-warmup", "5"], "argument --lars-warmup: 5 warm-up epochs do not fit"),
    (["model", "--gossip-rate", "2"], "argument --gossip-rate: 2 is a fraction of the rounds"),
    (["model", "--fan-efficiency", "1.5"], "argument --fan-efficiency: 1.5 is a fraction of the link's bandwidth"),
    (["train", "--period", "3"], "argument --period: 3 is odd"),
    (["stall", "--hosts", "2", "--link", "fast"], "argument --link: invalid link rate 'fast'"),
    (["box", "--hosts", "3", "--ranks-per-host", "1,2"], "argument --ranks-per-host: 2 values for 3 hosts"),
    (["box", "--hosts", "2", "--ranks-per-host", "1,0"], "2 ranks or more in all (a server and a worker)"),
    (["model", "--hosts", "2", "--ranks-per-host", "1,2"], "the model has the same ranks on every node"),
    (["model", "--hosts", "1"], "the network is measured between hosts: use 2 or more"),
    (["gossip", "--balance"], "use --sync-balance"),
    (["gossip", "--hosts", "2", "--ranks-per-host", "1,0"], "2 ranks or more in all"),
    (["nosuch"], "argument SUBCOMMAND: invalid choice: 'nosuch'"),
    (["hsgd.bench", "allreduce", "--hosts", "2"], "unrecognized arguments: --hosts 2"),  # emulated hosts: the lab's
    (["hsgd.bench", "io"], "argument SUBCOMMAND: invalid choice: 'io'"),
    (["hsgd.bench", "train", "--period", "3"], "argument --period: 3 is odd"),
    (["hsgd.bench", "train", "--methods", "DDP", "bogus"], "argument --methods: invalid choice: 'bogus'"),
    (["lab.bench", "train", "--hosts", "2", "--methods", "DDP"], "arguments --methods and --device: across emulated"),
    (["hsgd.bench", "staging", "--workloads", "resnet"], "argument --workloads: invalid choice: 'resnet'"),
])
def test_a_bad_option_gives_one_error_and_exit_2(args, message):
    named = args[0] in ("hsgd.bench", "lab.bench")  # the package named, else the one that runs the subcommand
    package = args[0] if named else PACKAGE.get(args[0], "lab.bench")
    args = args[1:] if named else args
    proc = subprocess.run([sys.executable, "-m", package, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)  # launches nothing
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], proc.stderr
    assert proc.stdout == ""


def test_train_times_the_methods_asked_for_and_the_two_every_table_needs(tmp_path):
    out = tmp_path / "train.json"
    proc = run_command([sys.executable, "-m", "hsgd.bench", "train", "--ranks", "2", "--workloads", "cnn",
                        "--steps", "1", "--repeats", "1", "--warmup", "0", "--cnn-batch", "8", "--no-local",
                        "--methods", "DDP", "--json", str(out), "--progress", "none"], timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert sorted(json.loads(out.read_text())["raw"][0]["times"]) == ["DDP", "hsgd", "no comm"]


@pytest.mark.parametrize("name", ["train", "staging"])
def test_device_cuda_without_a_gpu_is_refused_before_anything_runs(name):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --device cuda runs here (scripts/gpu_checks.sh)")
    proc = run_command([sys.executable, "-m", "hsgd.bench", name, "--device", "cuda"], timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].endswith(
        "argument --device: cuda, but torch sees no GPU here (torch.cuda.is_available() is False): run on a GPU "
        f"host, or {'use --device cpu' if name == 'train' else 'measure CPU staging with --device cpu'}"), proc.stderr
