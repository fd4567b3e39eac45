"""examples/: the Horovod-shaped scripts run end to end at tiny sizes, on 2 ranks."""

import os
import re

import pytest
import torch
from mpirun import ROOT, run_mpi

from hsgd.amp import probe_autocast

EXAMPLES = ROOT / "examples"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def run_mnist1d(cache, *extra, env=None):
    return run_mpi(2, [str(EXAMPLES / "pytorch_mnist1d.py"), "--samples", "2000", "--epochs", "2",
                       "--data-dir", cache, "--log-interval", "5", *extra],
                   env={"HSGD_RANKS_PER_NODE": "1", **(env or {})}, timeout=300)


def sigill_probe_env():
    """A job's environment in which the autocast probe's child dies of SIGILL, as on a CPU that
    advertises AMX its hypervisor does not enable (tests/amp_faults/sitecustomize.py on PYTHONPATH)."""
    return {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "amp_faults"),
                                           *filter(None, [os.environ.get("PYTHONPATH")])])}


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "mixed-precision"])
def test_mnist1d_example_trains_and_averages_its_test_metrics(cache, mixed):
    if mixed:  # bf16 autocast depends on the CPU: tried in a child process, where it may crash
        problem = probe_autocast("cpu", torch.bfloat16)
        if problem:
            pytest.skip(f"--use-mixed-precision cannot run on this machine: {problem}")
    proc = run_mnist1d(cache, *(["--use-mixed-precision"] if mixed else []))
    assert proc.returncode == 0, proc.stderr
    tests = re.findall(r"Test set: Average loss: ([0-9.]+), Accuracy: ([0-9.]+)%", proc.stdout)
    assert len(tests) == 2, proc.stdout  # once per epoch, rank 0 only
    assert float(tests[-1][1]) > 20.0, proc.stdout  # 10 classes: chance is 10 %
    assert proc.stdout.count("Train Epoch: 1 [0/") == 1


def test_mnist1d_example_whose_bf16_probe_fails_exits_2_with_one_error(cache):
    """As on a CPU that advertises AMX its hypervisor does not enable (simulated through the
    probe's child dying of SIGILL in the job, whatever ONEDNN_MAX_CPU_ISA is): one line with the
    fix, status 2, no training."""
    proc = run_mnist1d(cache, "--use-mixed-precision", env=sigill_probe_env())
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert errors[0].startswith("pytorch_mnist1d.py: error: --use-mixed-precision: bfloat16 autocast on the "
                                "CPU killed a test process with SIGILL (illegal instruction"), errors[0]
    assert "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16" in errors[0], errors[0]
    assert errors[0].endswith("drop --use-mixed-precision"), errors[0]
    assert "Train Epoch" not in proc.stdout


def test_synthetic_benchmark_reports_rates_and_compressed_traffic():
    proc = run_mpi(2, [str(EXAMPLES / "pytorch_synthetic_benchmark.py"), "--width", "64",
                       "--num-warmup-batches", "1", "--num-batches-per-iter", "2", "--num-iters", "2",
                       "--compression", "fp16"], env={"HSGD_RANKS_PER_NODE": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert len(re.findall(r"Iter #\d: [0-9.]+ samples/sec per rank", proc.stdout)) == 2, proc.stdout
    assert re.search(r"Total samples/sec on 2 rank\(s\): [0-9.]+ \+-[0-9.]+", proc.stdout), proc.stdout
    moved = re.search(r"([0-9.]+) MB across nodes", proc.stdout)
    assert moved and float(moved.group(1)) > 0, proc.stdout  # 2 virtual nodes: the sums crossed


def one_gpu_rank_env():
    """A job's environment in which rank 1 alone believes it has a GPU (tests/cuda_faults/sitecustomize.py)."""
    return {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "cuda_faults"),
                                           *filter(None, [os.environ.get("PYTHONPATH")])])}


def run_synthetic(*extra, env=None):
    return run_mpi(2, [str(EXAMPLES / "pytorch_synthetic_benchmark.py"), "--width", "64",
                       "--num-warmup-batches", "1", "--num-batches-per-iter", "2", "--num-iters", "2", *extra],
                   env={"HSGD_RANKS_PER_NODE": "1", **(env or {})}, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a GPU here: --device cuda would run")
@pytest.mark.parametrize("script", ["pytorch_mnist1d.py", "pytorch_synthetic_benchmark.py"])
@pytest.mark.parametrize("gpus", ["none", "rank 1 only"])
def test_example_with_device_cuda_and_no_gpu_exits_2_with_one_line(cache, script, gpus):
    """Every rank asks torch, the ranks agree (the minimum), every rank exits with 2 and rank 0
    says what to change: no hang, no traceback, no training; also where one rank believes it has a GPU."""
    env = one_gpu_rank_env() if gpus == "rank 1 only" else None
    proc = (run_mnist1d(cache, "--device", "cuda", env=env) if script == "pytorch_mnist1d.py"
            else run_synthetic("--device", "cuda", env=env))
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert errors[0] == (f"{script}: error: --device cuda, but torch sees no GPU on at least one rank; "
                         "use --device cpu or auto"), errors[0]
    assert "Train Epoch" not in proc.stdout and "Running benchmark" not in proc.stdout, proc.stdout


def test_synthetic_benchmark_device_auto_without_a_gpu_runs_on_the_cpu():
    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU here: auto picks it (test_examples_run_on_the_gpu)")
    proc = run_synthetic("--device", "auto", "--model", "cnn", env=one_gpu_rank_env())  # rank 1's "GPU" outvoted
    assert proc.returncode == 0, proc.stderr
    assert "Device: cpu" in proc.stdout.splitlines(), proc.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: torch.cuda.is_available() is False")
def test_examples_run_on_the_gpu(cache):
    """2 ranks on the host's GPUs (sharing one if there is one): MNIST-1D learns, with bf16 autocast
    on the GPU (no CPU probe), and the benchmark reports its rates on the GPU it names."""
    proc = run_mnist1d(cache, "--device", "cuda", "--use-mixed-precision")
    assert proc.returncode == 0, proc.stderr
    tests = re.findall(r"Test set: Average loss: ([0-9.]+), Accuracy: ([0-9.]+)%", proc.stdout)
    assert len(tests) == 2 and float(tests[-1][1]) > 20.0, proc.stdout
    proc = run_synthetic("--device", "cuda", "--compression", "fp16")
    assert proc.returncode == 0, proc.stderr
    assert f"Device: {torch.cuda.get_device_name(0)}" in proc.stdout.splitlines(), proc.stdout
    assert len(re.findall(r"Iter #\d: [0-9.]+ samples/sec per rank", proc.stdout)) == 2, proc.stdout
