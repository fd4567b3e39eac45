"""The guard of a run of emulated hosts: removes them if their owner dies without doing so.

Started by :class:`lab.hosts.EmulatedHosts` before any host is made, in a
session of its own (a signal to the owner's process group does not reach
it), as ``python -m lab.hosts._guard STATE_DIR`` with a pipe on its stdin
whose other end only the owner holds. It blocks reading that pipe: the owner
writes ``done`` once it has removed the hosts itself; end of file without
``done`` means the owner died (a SIGKILL, a timeout that killed the test
process), and the guard removes everything in ``STATE_DIR/state.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ._net import teardown


def main(state_dir: str) -> int:
    said = sys.stdin.read()
    if said.strip() == "done":
        return 0
    path = Path(state_dir) / "state.json"
    if not path.exists():
        return 0
    failed = teardown(json.loads(path.read_text()))
    if failed:
        sys.stderr.write(f"lab.hosts guard: could not remove {', '.join(failed)}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
