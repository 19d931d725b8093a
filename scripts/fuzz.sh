#!/usr/bin/env bash
# Property fuzzing for a fixed time: runs the property tests of what parses
# untrusted input (tests/properties.rs: key grammar, canonical JSON,
# durations, problem bodies; and the key parser's own properties) again and
# again, each round with fresh random inputs, until the budget is spent.
#
#   bash scripts/fuzz.sh [seconds, default 600] [cases per property and round, default 5000]
#
# FUZZ_PROFILE=dev uses the debug build the tests already made (CI does).
set -euo pipefail
cd "$(dirname "$0")/.."
budget=${1:-600}
cases=${2:-5000}
profile=()
if [[ "${FUZZ_PROFILE:-release}" == release ]]; then profile=(--release); fi
cargo test "${profile[@]}" --all-features --test properties --no-run -q
cargo test "${profile[@]}" -p idem-runtime --all-features --lib --no-run -q
end=$((SECONDS + budget))
rounds=0
while ((SECONDS < end)); do
    PROPTEST_CASES=$cases cargo test "${profile[@]}" --all-features --test properties -q >/dev/null
    PROPTEST_CASES=$cases cargo test "${profile[@]}" -p idem-runtime --all-features --lib key:: -q >/dev/null
    rounds=$((rounds + 1))
done
echo "fuzz: $rounds rounds in ${budget}s, $cases cases per property per round, no failure"
