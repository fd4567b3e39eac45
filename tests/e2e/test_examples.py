"""examples/: the Horovod-shaped scripts run end to end at tiny sizes, on 2 ranks."""

import re

import pytest
from mpirun import ROOT, run_mpi

EXAMPLES = ROOT / "examples"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def test_mnist1d_example_trains_and_averages_its_test_metrics(cache):
    proc = run_mpi(2, [str(EXAMPLES / "pytorch_mnist1d.py"), "--samples", "2000", "--epochs", "2",
                       "--data-dir", cache, "--use-mixed-precision", "--log-interval", "5"],
                   env={"HSGD_RANKS_PER_NODE": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    tests = re.findall(r"Test set: Average loss: ([0-9.]+), Accuracy: ([0-9.]+)%", proc.stdout)
    assert len(tests) == 2, proc.stdout  # once per epoch, rank 0 only
    assert float(tests[-1][1]) > 20.0, proc.stdout  # 10 classes: chance is 10 %
    assert proc.stdout.count("Train Epoch: 1 [0/") == 1


def test_synthetic_benchmark_reports_rates_and_compressed_traffic():
    proc = run_mpi(2, [str(EXAMPLES / "pytorch_synthetic_benchmark.py"), "--width", "64",
                       "--num-warmup-batches", "1", "--num-batches-per-iter", "2", "--num-iters", "2",
                       "--compression", "fp16"], env={"HSGD_RANKS_PER_NODE": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert len(re.findall(r"Iter #\d: [0-9.]+ samples/sec per rank", proc.stdout)) == 2, proc.stdout
    assert re.search(r"Total samples/sec on 2 rank\(s\): [0-9.]+ \+-[0-9.]+", proc.stdout), proc.stdout
    moved = re.search(r"([0-9.]+) MB across nodes", proc.stdout)
    assert moved and float(moved.group(1)) > 0, proc.stdout  # 2 virtual nodes: the sums crossed
