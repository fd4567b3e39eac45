"""The test suite's own leak check (tests/leftovers.py) finds what it must, and only that."""

import os

import pytest
from leftovers import leftovers, remove, snapshot

SHM = "/dev/shm"


@pytest.fixture
def shm_file():
    if not os.path.isdir(SHM):
        pytest.skip("no /dev/shm")
    made = []

    def make(name):
        path = os.path.join(SHM, f"{name}_{os.getpid()}")
        open(path, "w").close()
        made.append(path)
        return path
    yield make
    remove(made)


def test_a_new_unused_file_is_left_behind_and_an_old_one_is_not(shm_file):
    old = shm_file("hsgd_test_old")
    before = snapshot()
    new = shm_file("mpich_shm_hsgdtest")
    assert leftovers(before) == [new]
    assert old not in leftovers(before)


def test_a_file_held_open_or_mapped_is_in_use(shm_file):
    import mmap
    before = snapshot()
    held, mapped = shm_file("mpich_shm_held"), shm_file("mpich_shm_mapped")
    with open(mapped, "r+b") as f:
        f.truncate(4096)
        view = mmap.mmap(f.fileno(), 4096)
    with open(held, "rb"):
        assert leftovers(before) == []  # one held open, one mapped (its descriptor closed)
    view.close()
    assert set(leftovers(before)) == {held, mapped}


def test_mpi_only_ignores_other_programs_files(shm_file):
    before = snapshot()
    other, ours = shm_file("someones_cache"), shm_file("sm_segment.hsgdtest")
    assert leftovers(before, mpi_only=True) == [ours]
    assert set(leftovers(before)) == {other, ours}
