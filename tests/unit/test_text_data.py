"""Layer 1: ``python -m hsgd.data text``: byte tokens of a corpus, blocks, split, record."""

import hashlib
import sysconfig
from pathlib import Path

import h5py
import numpy as np
import pytest

from hsgd import InputError
from hsgd._io.tokens import read_corpus, stdlib_files, write_tokens
from hsgd.data import ensure_stdlib_tokens, main
from hsgd.parallel_io import ContiguousH5Loader


class OneRank:
    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def allgather(self, value):
        return [value]


@pytest.fixture
def corpus(tmp_path):
    """Three files of distinct bytes (every byte value occurs), 10 007 bytes in all."""
    gen = np.random.default_rng(1)
    sizes = (4000, 1, 6006)
    paths = []
    for i, size in enumerate(sizes):
        path = tmp_path / f"part{i}.txt"
        path.write_bytes(gen.integers(0, 256, size, dtype=np.uint8).tobytes())
        paths.append(str(path))
    return paths, b"".join(Path(p).read_bytes() for p in paths)


def read(path):
    with h5py.File(path, "r") as f:
        return {k: f[k][()] for k in f}, dict(f.attrs)


def run(capsys, *argv):
    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_blocks_give_back_the_corpus_and_y_is_x_shifted_by_one(tmp_path, corpus):
    paths, text = corpus
    path = write_tokens(tmp_path / "t.h5", paths, block_size=64, val_fraction=0.1, seed=3)
    data, attrs = read(path)
    n = (len(text) - 1) // 64  # 156 blocks; the last 22 bytes (but one) are not a whole block
    rows = np.concatenate([data["block_train"], data["block_test"]])
    x = np.concatenate([data["x_train"], data["x_test"]])[np.argsort(rows)]
    y = np.concatenate([data["y_train"], data["y_test"]])[np.argsort(rows)]
    assert x.dtype == y.dtype == np.uint8 and x.shape == y.shape == (n, 64)
    assert x.tobytes() == text[:n * 64]
    assert y.tobytes() == text[1:n * 64 + 1]
    assert np.array_equal(x[:, 1:], y[:, :-1]) and np.array_equal(x[1:, 0], y[:-1, -1])
    # the split: whole blocks, 10 % (rounded) validate, no block in both, none missing
    assert len(data["block_test"]) == round(0.1 * n) == 16 and len(data["block_train"]) == n - 16
    assert sorted(rows) == list(range(n))
    assert list(data["block_test"]) == sorted(data["block_test"])  # validation in corpus order
    assert list(data["block_train"]) != sorted(data["block_train"])  # training shuffled
    assert attrs["kind"] == "tokens" and attrs["vocab_size"] == 256 and attrs["block_size"] == 64
    assert attrs["sha256"] == hashlib.sha256(text).hexdigest() and attrs["corpus_bytes"] == len(text)
    assert attrs["num_files"] == 3 and [f.decode() for f in data["files"]] == paths
    assert attrs["source"] == "files" and attrs["seed"] == 3


def test_split_is_seeded_and_reproducible(tmp_path, corpus):
    paths, _ = corpus
    first, again, other = (read(write_tokens(tmp_path / name, paths, block_size=32, seed=seed))[0]
                           for name, seed in (("a.h5", 0), ("b.h5", 0), ("c.h5", 1)))
    assert all(np.array_equal(first[k], again[k]) for k in first)
    assert not np.array_equal(first["block_test"], other["block_test"])


def test_max_bytes_keeps_a_prefix_and_records_only_the_files_read(tmp_path, corpus):
    paths, text = corpus
    data, attrs = read(write_tokens(tmp_path / "t.h5", paths, block_size=16, max_bytes=4001))
    assert attrs["corpus_bytes"] == 4001 and attrs["num_files"] == 2
    assert attrs["sha256"] == hashlib.sha256(text[:4001]).hexdigest()
    assert [f.decode() for f in data["files"]] == paths[:2]
    assert len(data["block_train"]) + len(data["block_test"]) == 4000 // 16


def test_default_corpus_is_the_standard_library_without_site_packages(tmp_path):
    root, files = stdlib_files()
    assert root == Path(sysconfig.get_paths()["stdlib"])
    assert files == sorted(files) and len(files) > 500 and "os.py" in files
    assert not [f for f in files if "site-packages" in f.split("/") or not f.endswith(".py")]
    path = ensure_stdlib_tokens(tmp_path / "cache", block_size=128, max_bytes=50_000)
    data, attrs = read(path)
    assert attrs["source"] == "stdlib" and attrs["root"] == str(root) and attrs["corpus_bytes"] == 50_000
    read_files = [f.decode() for f in data["files"]]
    assert read_files == files[:len(read_files)] and attrs["num_files"] == len(read_files)
    corpus, _, digest = read_corpus(read_files, root, 50_000)
    assert digest == attrs["sha256"] and data["x_test"][0].tobytes() in corpus.tobytes()
    stamp = path.stat().st_mtime_ns
    assert ensure_stdlib_tokens(tmp_path / "cache", block_size=128, max_bytes=50_000) == path
    assert path.stat().st_mtime_ns == stamp  # cached, not written again


def test_loader_batches_next_byte_targets(tmp_path, corpus):
    paths, text = corpus
    path = write_tokens(tmp_path / "t.h5", paths, block_size=50)
    with ContiguousH5Loader(path, "x_train", "y_train", batch_size=8, comm=OneRank(),
                            return_indices=True) as loader:
        assert loader.sample_shape == (50,) and loader.label_shape == (50,)
        for x, y, _ in loader:
            assert x.shape == y.shape == (8, 50) and y.dtype.is_signed
            for row_x, row_y in zip(x.numpy(), y.numpy()):
                at = text.index(row_x.tobytes())
                assert bytes(row_y.astype(np.uint8)) == text[at + 1:at + 51]


@pytest.mark.parametrize("argv,message", [
    (["--block-size", "0"], "--block-size must be a positive integer"),
    (["--block-size", "6000"], "fewer than two blocks of 6000 bytes"),
    (["--val-fraction", "0"], "--val-fraction must be between 0 and 1"),
    (["--val-fraction", "1"], "--val-fraction must be between 0 and 1"),
    (["--val-fraction", "0.99", "--block-size", "4000"], "leaves no training block"),
    (["--max-bytes", "0"], "--max-bytes must be a positive integer"),
    (["--seed", "-1"], "--seed must be an integer >= 0"),
])
def test_bad_options_say_what_to_change(tmp_path, corpus, capsys, argv, message):
    paths, _ = corpus
    status, _, err = run(capsys, "text", *paths, "-o", tmp_path / "t.h5", *argv)
    assert status == 1 and message in err and err.count("error:") == 1, err
    assert not (tmp_path / "t.h5").exists()


def test_missing_and_directory_inputs(tmp_path, corpus, capsys):
    paths, _ = corpus
    status, _, err = run(capsys, "text", paths[0], tmp_path / "nope.txt", "-o", tmp_path / "t.h5")
    assert status == 1 and "text file not found" in err and "nope.txt" in err
    status, _, err = run(capsys, "text", tmp_path, "-o", tmp_path / "t.h5")
    assert status == 1 and "not a regular file" in err
    with pytest.raises(InputError, match="no text files"):
        write_tokens(tmp_path / "t.h5", [])


def test_cli_writes_and_describes(tmp_path, corpus, capsys):
    paths, _ = corpus
    status, out, _ = run(capsys, "text", *paths, "-o", tmp_path / "t.h5", "--block-size", "100", "--compress")
    assert status == 0 and "x_train" in out and "kind=tokens" in out and "gzip(4)" in out
