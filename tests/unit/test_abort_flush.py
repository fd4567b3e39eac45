"""Before MPI_Abort, a rank waits until the launcher has read what it wrote (hsgd.faults.abort)."""

import os
import sys

from hsgd.faults.abort import flush_to_launcher


def _with_stderr_on_a_pipe(body):
    read_end, write_end = os.pipe()
    saved = os.dup(2)
    sys.stderr.flush()
    os.dup2(write_end, 2)
    try:
        return body(read_end)
    finally:
        os.dup2(saved, 2)
        for fd in (saved, read_end, write_end):
            os.close(fd)


def test_it_waits_until_the_reader_took_every_byte_and_no_longer_than_its_timeout():
    def body(read_end):
        os.write(2, b"why the job ends\n")
        unread = flush_to_launcher(timeout=0.2)  # nobody reads yet
        taken = os.read(read_end, 100)
        return unread, taken, flush_to_launcher(timeout=0.2)

    unread, taken, read = _with_stderr_on_a_pipe(body)
    assert (unread, taken, read) == (False, b"why the job ends\n", True)


def test_it_returns_at_once_where_stderr_is_not_a_pipe(tmp_path):
    with open(tmp_path / "log", "w") as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            assert flush_to_launcher(timeout=0.0)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
