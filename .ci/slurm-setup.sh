#!/usr/bin/env bash
# Install a Slurm (controller, node daemon, client commands) for tests/e2e/test_slurm.py.
#
# CI runs this as root before the tests. It is idempotent: if the binaries are
# already there it does nothing. It only installs packages; no daemon is started
# (tests/e2e/slurm_cluster.py starts a private cluster on loopback and stops it).
# munge comes in as a dependency but is not used (the test cluster runs with
# AuthType=auth/none).
set -euo pipefail

start=$(date +%s)
export PATH="$PATH:/usr/sbin:/sbin"   # the daemons live in sbin
# (sbatch --version needs a slurm.conf in 22.05, so ask dpkg instead)
slurm_version() { dpkg-query -W -f='${Version}' slurm-client 2>/dev/null || echo unknown; }
need=(slurmctld slurmd sbatch srun scontrol squeue sinfo scancel)
missing=()
for b in "${need[@]}"; do
    command -v "$b" >/dev/null 2>&1 || missing+=("$b")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "slurm-setup: Slurm already installed ($(slurm_version))"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "slurm-setup: missing ${missing[*]}; need root to apt-get install them" >&2
    exit 1
fi

echo "slurm-setup: installing slurmctld slurmd slurm-client (missing: ${missing[*]})"
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
if ! { apt-get update -qq &&
       apt-get install -y -qq --no-install-recommends \
           -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
           slurmctld slurmd slurm-client; } >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "slurm-setup: apt-get failed (last 40 lines of its output above)" >&2
    exit 1
fi
rm -f "$log"

for b in "${need[@]}"; do
    command -v "$b" >/dev/null 2>&1 || { echo "slurm-setup: $b still missing after install" >&2; exit 1; }
done
echo "slurm-setup: installed Slurm $(slurm_version) in $(( $(date +%s) - start )) s"
