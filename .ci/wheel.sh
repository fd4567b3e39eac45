#!/usr/bin/env bash
# The wheel as a user gets it: build an sdist and a wheel (python -m build), check their
# metadata (twine check), install the wheel in a fresh virtual environment, and run the main
# job's trainer for one epoch there, on 2 ranks, from a directory outside the checkout (so that
# the installed package is imported, not the source tree: a module missing from the wheel fails
# here). Everything goes to a temporary directory removed at the end.
#
# Usage: bash .ci/wheel.sh [PYTHON]   (PYTHON: one with build and twine, default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
python=${1:-.venv/bin/python}
work=$(mktemp -d "${TMPDIR:-/tmp}/hsgd-wheel-XXXXXX")
trap 'rm -rf "$work"' EXIT

"$python" -m build --outdir "$work/dist" . > "$work/build.log" 2>&1 || { cat "$work/build.log" >&2; exit 1; }
"$python" -m twine check --strict "$work"/dist/*
wheel=$(ls "$work"/dist/hsgd-*.whl)
echo "wheel.sh: built" $(cd "$work/dist" && ls)

python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q -c "$root/constraints.txt" "${wheel}[mpich,train]"
cd "$work"
"$work/venv/bin/python" -c "import hsgd, sys; assert hsgd.__file__.startswith('$work/venv'), hsgd.__file__; print('wheel.sh: hsgd', hsgd.__version__, 'from', hsgd.__file__)"
timeout 300 "$work/venv/bin/mpiexec" -n 2 "$work/venv/bin/python" -m hsgd.train --epochs 1 --run-dir "$work/run"
test -s "$work/run/metrics.jsonl"
echo "wheel.sh: the installed wheel trained one epoch on 2 ranks"
