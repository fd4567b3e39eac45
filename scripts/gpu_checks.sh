#!/usr/bin/env bash
# The GPU checks (CONTRIBUTING.md, "On a GPU"): run from a clone's root on a machine with a
# GPU, an image's python3 with torch (CUDA), mpi4py, h5py and pytest, and no registry.
#
#   bash scripts/gpu_checks.sh [WHEELS_DIR] [DATA_DIR] [OUT_DIR] [STEPS]
#
# WHEELS_DIR (gpucarry/wheels): wheels to install first, --no-deps, offline (mpich, tqdm,
#   pytest-timeout: `pip download --no-deps mpich tqdm pytest-timeout -d gpucarry/wheels`);
# DATA_DIR (gpucarry/data): the MNIST-1D files, generated beforehand where mnist1d installs
#   (`python -m hsgd.data mnist1d ...`, or copies of ~/.cache/hsgd), so the GPU machine needs
#   neither mnist1d nor scipy;
# OUT_DIR ($OUT, else gpu-out): one log per step, and the benchmarks' JSON;
# STEPS (all but alt-*): which steps to run, e.g. "setup tests bench";
# ALT (env): the root of another checkout (its hsgd/ and tests/), for alt-tests and alt-staging.
# Every step has its own timeout and goes on to the next when one fails; the last lines of
# each log and its exit status are printed at the end.
set -u
WHEELS=${1:-gpucarry/wheels}
DATA=${2:-gpucarry/data}
OUT=${3:-${OUT:-gpu-out}}
ALT=${ALT:+$(cd "$ALT" && pwd)}
STEPS=${4:-setup smi tests train examples staging bench accuracy}
[ -n "$ALT" ] && [ -z "${4:-}" ] && STEPS="setup smi tests alt-tests train examples staging alt-staging bench alt-bench accuracy"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
DATA=$(cd "$DATA" && pwd)
export HSGD_CACHE_DIR=$DATA PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
declare -a SUMMARY=()

step() {  # step NAME TIMEOUT COMMAND...: run it, log it, note its status
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    echo "=== $name: $*" | tee "$OUT/$name.log"
    timeout -k 10 "$limit" "$@" >>"$OUT/$name.log" 2>&1
    local rc=$?
    SUMMARY+=("$name rc=$rc $((SECONDS - start))s")
    echo "--- $name: rc=$rc in $((SECONDS - start)) s" | tee -a "$OUT/$name.log"
    tail -n 25 "$OUT/$name.log"
}

setup() {
    # a venv over the image's packages, so that pip may install; the image's own python if that
    # venv does not see torch (the image's python a venv itself) or cannot be made (no ensurepip)
    if $PY -m venv --system-site-packages /tmp/hsgd-gpu-venv \
            && /tmp/hsgd-gpu-venv/bin/python -c 'import torch, mpi4py, h5py, pytest'; then
        PY=/tmp/hsgd-gpu-venv/bin/python
    fi
    $PY -m pip install --no-deps --no-index "$WHEELS"/*.whl \
        || $PY -m pip install --no-deps --no-index --break-system-packages "$WHEELS"/*.whl
    $PY -m pip install --no-deps --no-index --no-build-isolation -e . \
        || $PY -m pip install --no-deps --no-index --no-build-isolation --break-system-packages -e . \
        || echo "editable install failed: using PYTHONPATH=$PWD"
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    local bin lib
    bin=$($PY -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
    export PATH=$bin:$PATH
    # the mpich wheel's libmpi, wherever pip put it (mpi4py looks in the venv's prefix, not /usr/local)
    lib=$($PY -c 'import glob, site, sys
bases = [sys.prefix, sys.base_prefix, site.USER_BASE, "/usr/local"]
print(next((f.rsplit("/", 1)[0] for b in bases for f in glob.glob(b + "/lib*/libmpi.so*")), ""))')
    [ -n "$lib" ] && export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    echo "python $PY, mpiexec from $bin, libmpi in ${lib:-(not found)}"
    $PY -c 'import mpi4py, torch, hsgd; print("mpi4py", mpi4py.__version__, "torch", torch.__version__,
"cuda", torch.version.cuda, torch.cuda.is_available(), torch.cuda.device_count())'
    $PY -c 'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])'
    command -v mpiexec
}

for s in $STEPS; do
    case $s in
    setup) echo "=== setup" | tee "$OUT/setup.log"; setup >>"$OUT/setup.log" 2>&1; SUMMARY+=("setup rc=$?")
           tail -n 8 "$OUT/setup.log";;
    smi) step smi 30 nvidia-smi;;
    tests)
        for n in 1 2; do
            step "mpi-tests-$n" 240 mpiexec -n "$n" "$PY" -m mpi4py -m pytest -q -o addopts= -p no:cacheprovider \
                -rs tests/mpi/test_collectives_mpi.py tests/mpi/test_compression_mpi.py \
                tests/mpi/test_optimizer_api_mpi.py tests/mpi/test_hsgd_mpi.py tests/mpi/test_overlap_mpi.py
        done;;
    train) step train-cuda 240 mpiexec -n 2 "$PY" -m hsgd.train --device cuda --epochs 2;;
    examples)
        step example-mnist1d 240 mpiexec -n 2 "$PY" examples/pytorch_mnist1d.py --device cuda --epochs 2 \
            --data-dir "$DATA"
        step example-mnist1d-amp 240 mpiexec -n 2 "$PY" examples/pytorch_mnist1d.py --device cuda --epochs 2 \
            --data-dir "$DATA" --use-mixed-precision
        step example-synthetic 240 mpiexec -n 2 "$PY" examples/pytorch_synthetic_benchmark.py --device cuda;;
    staging) step staging 300 "$PY" -m hsgd.bench staging --device cuda --ranks 1 2 \
                 --workloads mlp2m mlp deep cnn --json "$OUT/staging.json";;
    # another checkout (in $ALT, e.g. a branch's: git worktree, or its files copied) beside this
    # one, run from its root: its cuda tests and its staging, for a before/after on one machine
    alt-tests) step alt-mpi-tests-2 240 env -C "$ALT" PYTHONPATH="$ALT" mpiexec -n 2 "$PY" -m mpi4py -m pytest -q \
                   -o addopts= -p no:cacheprovider -rs tests/mpi/test_hsgd_mpi.py tests/mpi/test_overlap_mpi.py \
                   tests/mpi/test_compression_mpi.py tests/mpi/test_optimizer_api_mpi.py;;
    alt-staging) step alt-staging 300 env -C "$ALT" PYTHONPATH="$ALT" "$PY" -m hsgd.bench staging --device cuda \
                     --ranks 1 2 --workloads mlp2m mlp deep cnn --json "$OUT/alt-staging.json";;
    bench) step bench-train 300 "$PY" -m hsgd.bench train --device cuda --ranks 2 --workloads mlp cnn deep \
               --repeats 5 --no-local --methods "hsgd overlap" DDP "DDP bucket view" --json "$OUT/train.json"
           step bench-horovod 200 "$PY" -m hsgd.bench train --device cuda --ranks 2 --workloads mlp --repeats 3 \
               --no-local --methods hsgd.horovod "hsgd.horovod overlap" --json "$OUT/train-horovod.json";;
    alt-bench) step alt-bench-train 300 env -C "$ALT" PYTHONPATH="$ALT" "$PY" -m hsgd.bench train --device cuda \
                   --ranks 2 --workloads mlp cnn deep --repeats 5 --no-local --methods "hsgd overlap" DDP \
                   "DDP bucket view" --json "$OUT/alt-train.json";;
    accuracy) step accuracy 400 mpiexec -n 2 "$PY" -m hsgd.train --device cuda;;
    *) echo "unknown step $s";;
    esac
done
echo "=== summary"
printf '%s\n' "${SUMMARY[@]}"
