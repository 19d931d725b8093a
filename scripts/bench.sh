#!/usr/bin/env bash
# The figures of BENCHMARKS.md, in one run: the harness (every variant at
# 1, 16 and 64 clients, 3 rounds back to back), its plot, the server's CPU
# per request without the network, the memory store growing past a million
# records, a 10-million-record PostgreSQL table against an empty one, the
# statements on the database alone (pgbench) and in its executor alone,
# and the criterion micro-benchmarks.
#
#   bash scripts/bench.sh            # everything (20 to 25 minutes)
#   bash scripts/bench.sh quick      # the harness alone, 1 round
#
# Needs DATABASE_URL (PostgreSQL) for the PostgreSQL and hand-written cells.
set -euo pipefail
cd "$(dirname "$0")/.."
export DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}"
out=target/bench
mkdir -p "$out"
cargo build --release -p idem-bench
bench=target/release/bench

if [ "${1:-}" = quick ]; then
    "$bench" --seconds 2 --repeat 1 --csv "$out/bench.csv"
    python3 scripts/plot-bench.py "$out/bench.csv" "$out/bench.svg"
    exit
fi

echo "== the harness: 3 rounds of every cell"
"$bench" --seconds 2 --repeat 3 --csv "$out/bench.csv" | tee "$out/bench.txt"
python3 scripts/plot-bench.py "$out/bench.csv" docs/bench.svg
# The database-bound variants alone, on a scale they can be told apart.
(head -1 "$out/bench.csv"; grep -E '^(hand-written|idem postgres|idem sqlite)' "$out/bench.csv") > "$out/databases.csv"
python3 scripts/plot-bench.py "$out/databases.csv" docs/bench-databases.svg

echo "== the server's CPU per request, without the network"
"$bench" --cpu 20000 | tee "$out/cpu.txt"
echo "-- 16 requests under way at once"
"$bench" --cpu 20000 --inflight 16 | tee -a "$out/cpu.txt"

echo "== the memory store growing past a million records"
"$bench" --growth 1200000 | tee "$out/growth.txt"

echo "== table size: PostgreSQL cells on empty tables, then on 10 million records"
"$bench" --only bare,hand,postgres --clients 16 --seconds 2 --repeat 3 | tee "$out/table-empty.txt"
"$bench" --only bare,hand,postgres --clients 16 --seconds 2 --repeat 3 --prefill 10000000 | tee "$out/table-10m.txt"

echo "== the statements on the database alone (pgbench)"
"$bench" --pgbench --repeat 3 --seconds 4 | tee "$out/pgbench.txt"

echo "== the statements in PostgreSQL's executor alone (one backend, a PL/pgSQL loop)"
"$bench" --pgexec | tee "$out/pgexec.txt"

echo "== micro-benchmarks"
cargo bench -p idem-runtime --bench micro -- --warm-up-time 1 --measurement-time 3 | tee "$out/micro.txt"
