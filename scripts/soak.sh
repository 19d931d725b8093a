#!/usr/bin/env bash
# Every soak of RELIABILITY.md, one after the other: the large runs on both
# stores, then one run per fault. Prints each run's table and, at the end,
# the RELIABILITY rows. Needs DATABASE_URL=postgres://... and, for the
# restart fault, the right to run pg_ctlcluster (root); the clock fault
# needs libfaketime (apt-get install faketime).
#
#   bash scripts/soak.sh [large operations, default 20000] [fault operations, default 5000]
set -euo pipefail
cd "$(dirname "$0")/.."
large=${1:-20000}
fault=${2:-5000}
: "${DATABASE_URL:?set DATABASE_URL=postgres://...}"
cargo build --release --all-features --example payments --example soak
soak=target/release/examples/soak
rows=()
run() {
    echo "== soak $*"
    # Each run shown as it goes, on the script's own stderr (not reopened,
    # so that stdout and stderr sent to one file do not overwrite each other).
    out=$("$soak" "$@" | tee >(cat >&2)) || true
    rows+=("$(grep '^RELIABILITY row' <<<"$out" | sed 's/^RELIABILITY row: //') \`soak $*\` |")
}
run --store postgres --ops "$large" --clients 32 --tenants 400
run --store sqlite --ops "$large" --clients 32 --tenants 400
run --store postgres --ops "$fault" --fault kill-connections
run --store postgres --ops "$fault" --fault restart-postgres
run --store postgres --ops "$fault" --fault kill-process
run --store sqlite --ops "$fault" --fault kill-process
run --store postgres --ops "$fault" --fault stall
run --store postgres --ops "$fault" --fault clock
run --store sqlite --ops "$fault" --fault clock
echo
echo "| store | fault | operations | requests | effects | lost answers | double effects | 503s | verdict | command |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
printf '%s\n' "${rows[@]}"
