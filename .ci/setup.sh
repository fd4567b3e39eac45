#!/usr/bin/env bash
# What the tests need from the system, installed if missing (CI runs this as root before the
# tests; it is idempotent and starts nothing):
# - a Slurm (controller, node daemon, client commands) for tests/e2e/test_slurm.py, whose
#   private cluster (tests/e2e/slurm_cluster.py) runs with AuthType=auth/none: munge comes in
#   as a dependency but is not used;
# - ip and tc (iproute2), nsenter, unshare and setpriv (util-linux) for tests/hosts, which make
#   hosts out of network namespaces (lab.hosts). Whether the kernel and the container let us
#   make namespaces, veths, bridges and tbf queues is checked by making some: a missing
#   capability fails those tests under CI=true, so this script does not hide it.
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"   # the daemons and ip live in sbin

# need WHAT TOOL... -- PACKAGE...: apt-get install the packages if a tool is missing.
need() {
    local what=$1 tools=() packages=() missing=()
    shift
    while [ "$1" != "--" ]; do tools+=("$1"); shift; done
    shift
    packages=("$@")
    for t in "${tools[@]}"; do command -v "$t" >/dev/null 2>&1 || missing+=("$t"); done
    if [ ${#missing[@]} -eq 0 ]; then
        echo "setup: $what: ${tools[*]} present"
        return 0
    fi
    if [ "$(id -u)" -ne 0 ]; then
        echo "setup: $what: missing ${missing[*]}; need root to apt-get install them" >&2
        return 1
    fi
    local start log
    start=$(date +%s)
    log=$(mktemp)
    echo "setup: $what: installing ${packages[*]} (missing: ${missing[*]})"
    if ! { apt-get update -qq &&
           DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
               -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "${packages[@]}"; } >"$log" 2>&1; then
        tail -n 40 "$log" >&2
        echo "setup: $what: apt-get failed (last 40 lines of its output above)" >&2
        return 1
    fi
    rm -f "$log"
    for t in "${tools[@]}"; do
        command -v "$t" >/dev/null 2>&1 || { echo "setup: $what: $t still missing after install" >&2; return 1; }
    done
    echo "setup: $what: installed in $(( $(date +%s) - start )) s"
}

need "Slurm" slurmctld slurmd sbatch srun scontrol squeue sinfo scancel -- slurmctld slurmd slurm-client
need "emulated hosts" ip tc nsenter unshare setpriv -- iproute2 util-linux
