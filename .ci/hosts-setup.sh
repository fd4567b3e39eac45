#!/usr/bin/env bash
# The tools that tests/hosts needs to make emulated hosts (hsgd.hosts): ip and tc (iproute2),
# nsenter and unshare (util-linux). CI runs this as root before the tests; it only installs
# what is missing. Whether this kernel and this container let us make namespaces, veths,
# bridges and tbf queues is checked by making some: a missing capability fails the tests
# under CI=true (tests/hosts/conftest.py), so this script does not hide it.
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"
missing=()
for tool in ip tc nsenter unshare setpriv; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "hosts-setup: ip, tc, nsenter, unshare, setpriv present"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "hosts-setup: missing ${missing[*]}; need root to apt-get install them" >&2
    exit 1
fi
echo "hosts-setup: installing iproute2 util-linux (missing: ${missing[*]})"
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends iproute2 util-linux; } >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "hosts-setup: apt-get failed (last 40 lines of its output above)" >&2
    exit 1
fi
rm -f "$log"
