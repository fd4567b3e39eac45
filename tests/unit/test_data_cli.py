"""Layer 1: ``python -m hsgd.data`` (convert, mnist1d, inspect) on small data."""

import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from hsgd.data import describe, ensure_mnist1d, main, write_dataset, write_mnist1d
from hsgd.parallel_io import ContiguousH5Loader, loader_block_size

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def npy(tmp_path):
    x = np.random.default_rng(0).normal(size=(300, 3, 4)).astype(np.float32)
    y = np.arange(300) % 7
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    return x, y, tmp_path


def run(capsys, *argv):
    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_convert_writes_a_seeded_shuffle_in_loader_layout(npy, capsys):
    x, y, d = npy
    status, out, _ = run(capsys, "convert", "--x", d / "x.npy", "--y", d / "y.npy",
                         "-o", d / "out.h5", "--seed", 3)
    assert status == 0 and "loader block" in out
    order = np.random.default_rng(3).permutation(300)
    with h5py.File(d / "out.h5") as f:
        np.testing.assert_array_equal(f["x"][:], x[order])
        np.testing.assert_array_equal(f["y"][:], y[order])
        assert f["x"].chunks[1:] == (3, 4) and f["y"].chunks == f["x"].chunks[:1]
        assert loader_block_size(f["x"]) % f["x"].chunks[0] == 0
        assert f["x"].compression is None


def test_convert_no_shuffle_split_and_compress(npy, capsys):
    x, y, d = npy
    status, _, _ = run(capsys, "convert", "--x", d / "x.npy", "--y", d / "y.npy", "-o",
                       d / "out.h5", "--no-shuffle", "--test-fraction", 0.2, "--compress")
    assert status == 0
    with h5py.File(d / "out.h5") as f:
        assert sorted(f) == ["x_test", "x_train", "y_test", "y_train"]
        np.testing.assert_array_equal(f["x_train"][:], x[:240])
        np.testing.assert_array_equal(f["y_test"][:], y[240:])
        assert f["x_train"].compression == "gzip" and f["y_test"].compression == "gzip"
    with ContiguousH5Loader(d / "out.h5", "x_train", "y_train", batch_size=16) as loader:
        assert sum(len(b[1]) for b in loader) == 240


def test_convert_writes_native_byte_order(tmp_path, capsys):
    x = np.arange(40, dtype=">f4").reshape(20, 2)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", np.arange(20, dtype=">i8") % 3)
    assert run(capsys, "convert", "--x", tmp_path / "x.npy", "--y", tmp_path / "y.npy",
               "-o", tmp_path / "o.h5", "--no-shuffle")[0] == 0
    with h5py.File(tmp_path / "o.h5") as f:
        assert f["x"].dtype.isnative and f["y"].dtype.isnative
        np.testing.assert_array_equal(f["x"][:], x)
    with ContiguousH5Loader(tmp_path / "o.h5", batch_size=4) as loader:
        assert loader._source.direct


def test_convert_from_npz(tmp_path, capsys):
    np.savez(tmp_path / "d.npz", inputs=np.ones((20, 2), np.int16), labels=np.arange(20))
    status, _, err = run(capsys, "convert", "--npz", tmp_path / "d.npz", "-o", tmp_path / "o.h5")
    assert status == 1 and "has no array 'x'; it has: inputs, labels; pass --npz-x" in err
    status, _, _ = run(capsys, "convert", "--npz", tmp_path / "d.npz", "--npz-x", "inputs",
                       "--npz-y", "labels", "-o", tmp_path / "o.h5", "--no-shuffle")
    with h5py.File(tmp_path / "o.h5") as f:
        assert status == 0 and f["x"].dtype == np.int16 and f["y"][-1] == 19


@pytest.mark.parametrize("x,y,message", [
    (np.zeros((5, 2)), np.zeros(4, int), "x 'x' has 5 samples but y 'y' has 4 labels"),
    (np.zeros((0, 2)), np.zeros(0, int), "zero samples"),
    (np.array(["a", "b"]), np.zeros(2, int), "dtype <U1, which is not numeric"),
    (np.zeros((5, 2)), np.zeros(5), "labels must be integer class indices"),
    (np.zeros((5, 2)), np.array([0, 1, -1, 2, 3]), "negative label -1 at sample 2"),
    (np.zeros((5, 0)), np.zeros(5, int), "its samples are empty"),
])
def test_convert_rejects_bad_input(tmp_path, capsys, x, y, message):
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    status, out, err = run(capsys, "convert", "--x", tmp_path / "x.npy", "--y",
                           tmp_path / "y.npy", "-o", tmp_path / "o.h5")
    assert status == 1 and message in err and err.startswith("hsgd.data convert: error:")
    assert not list(tmp_path.glob("*.h5")) and not list(tmp_path.glob(".*tmp"))


def test_convert_missing_and_object_inputs(tmp_path, capsys):
    status, _, err = run(capsys, "convert", "--x", tmp_path / "no.npy", "--y",
                         tmp_path / "no.npy", "-o", tmp_path / "o.h5")
    assert status == 1 and "--x file not found" in err
    np.save(tmp_path / "obj.npy", np.array([{}, 1], dtype=object), allow_pickle=True)
    np.save(tmp_path / "y.npy", np.zeros(2, int))
    status, _, err = run(capsys, "convert", "--x", tmp_path / "obj.npy", "--y",
                         tmp_path / "y.npy", "-o", tmp_path / "o.h5")
    assert status == 1 and "holds Python objects, which are not numeric" in err


def test_failed_write_leaves_the_old_file_and_no_temporary(npy, capsys, monkeypatch):
    x, y, d = npy
    (d / "out.h5").write_bytes(b"old contents")

    real = h5py.Group.create_dataset

    def broken(group, name, *args, **kwargs):  # the first data set is made, then the disk is full
        real(group, name, data=np.zeros(3))
        raise OSError("quota exceeded")

    monkeypatch.setattr(h5py.Group, "create_dataset", broken)
    status, _, err = run(capsys, "convert", "--x", d / "x.npy", "--y", d / "y.npy",
                         "-o", d / "out.h5")
    assert status == 1 and "quota exceeded" in err
    assert (d / "out.h5").read_bytes() == b"old contents"
    assert sorted(p.name for p in d.iterdir()) == ["out.h5", "x.npy", "y.npy"]


def test_write_into_missing_directory(npy, capsys):
    _, _, d = npy
    status, _, err = run(capsys, "convert", "--x", d / "x.npy", "--y", d / "y.npy",
                         "-o", d / "nodir" / "o.h5")
    assert status == 1 and "does not exist" in err


def test_mnist1d_is_offline_deterministic_and_split(tmp_path, capsys):
    state = np.random.get_state()[1].copy()
    status, out, _ = run(capsys, "mnist1d", "-o", tmp_path / "a.h5", "--samples", 200)
    assert status == 0 and "x_train" in out
    write_mnist1d(tmp_path / "b.h5", num_samples=200)
    assert np.array_equal(np.random.get_state()[1], state)  # global RNG untouched
    with h5py.File(tmp_path / "a.h5") as a, h5py.File(tmp_path / "b.h5") as b:
        assert a["x_train"].shape == (160, 40) and a["x_test"].shape == (40, 40)
        assert a["x_train"].dtype == np.float32 and a["y_test"].dtype == np.int64
        assert set(np.unique(a["y_train"][:])) <= set(range(10))
        assert a.attrs["source"] == "mnist1d" and a.attrs["seed"] == 42
        for key in a:
            np.testing.assert_array_equal(a[key][:], b[key][:])


def test_mnist1d_matches_the_package(tmp_path):
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples, args.seed = 100, 7
    want = make_dataset(args)
    with h5py.File(write_mnist1d(tmp_path / "m.h5", num_samples=100, seed=7)) as f:
        np.testing.assert_allclose(f["x_test"][:], want["x_test"].astype(np.float32))
        np.testing.assert_array_equal(f["y_train"][:], want["y"])


def test_ensure_mnist1d_caches(tmp_path):
    path = ensure_mnist1d(tmp_path / "cache", num_samples=100)
    stamp = path.stat().st_mtime_ns
    assert ensure_mnist1d(tmp_path / "cache", num_samples=100) == path
    assert path.stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="num_samples"):
        write_mnist1d(tmp_path / "x.h5", num_samples=5)


def test_inspect(npy, capsys):
    x, y, d = npy
    write_dataset(d / "o.h5", x, y, compress=True)
    status, out, _ = run(capsys, "inspect", d / "o.h5")
    assert status == 0
    assert "x  " in out and "(300, 3, 4)" in out and "gzip(4)+shuffle" in out
    info = describe(d / "o.h5")
    rows = {row["name"]: row for row in info["datasets"]}
    assert rows["x"]["block"] % rows["x"]["chunks"][0] == 0 and rows["y"]["block"] is None


def test_module_entry_point_exit_status(tmp_path):
    (tmp_path / "t.h5").write_text("not hdf5")
    proc = subprocess.run([sys.executable, "-m", "hsgd.data", "inspect", str(tmp_path / "t.h5")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.count("is not an HDF5 file") == 1
