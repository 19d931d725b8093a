#!/usr/bin/env bash
# Instructions per request, counted by callgrind (the same count on every
# run of the same binary, whatever else the machine does): the bare handler
# and idem's first request, replay and 409 on the memory store, in process, with
# K requests under way at once on the one thread (default 16, as 16 clients
# keep the server's thread), the share of them spent in malloc and free,
# and the allocations per request (dhat).
#
#   bash scripts/count-instructions.sh        # --inflight 16
#   bash scripts/count-instructions.sh 1      # one request at a time
#
# Setup and the 100 completed keys are included. Needs valgrind. SHA-256
# runs in software under valgrind (no SHA instructions), about 13,900
# instructions of each keyed request that the CPU's own SHA instructions
# do in a fraction of that outside it.
#
# With DATABASE_URL set it also counts the server's instructions per
# PostgreSQL request, idem's and the hand-written flow's, one connection,
# one request at a time: each cell runs twice (5 rounds of 300, then of
# 600 requests) and the difference is divided by the 1,500 requests it
# adds, so that the setup (the schema, the completed keys) cancels out.
# The database's own work is not counted; the driver's is.
set -euo pipefail
cd "$(dirname "$0")/.."
inflight="${1:-16}"
n=2000
out=target/bench
mkdir -p "$out"
cargo build --release -p idem-bench
printf '%-22s %14s %14s %10s %12s\n' cell "instr/request" "malloc+free" "share" "allocations"
for cell in "bare" "idem memory first" "idem memory replay" "idem memory 409"; do
    file="$out/callgrind.$(echo "$cell" | tr ' ' '-').out"
    valgrind --tool=callgrind --callgrind-out-file="$file" \
        target/release/bench --cpu "$n" --inflight "$inflight" --only "$cell" >/dev/null 2>&1
    # 5 rounds of n requests, and 100 replay keys completed first (and, for
    # the 409s, 100 keys held).
    requests=$((5 * n + 100))
    [ "$cell" = "idem memory 409" ] && requests=$((requests + 100))
    # Allocations per request, counted by dhat (setup included, as above).
    dhat="$out/dhat.$(echo "$cell" | tr ' ' '-').json"
    valgrind --tool=dhat --dhat-out-file="$dhat" \
        target/release/bench --cpu "$n" --inflight "$inflight" --only "$cell" >/dev/null 2>&1
    blocks=$(python3 -c 'import json, sys; print(sum(p["tbk"] for p in json.load(open(sys.argv[1]))["pps"]))' "$dhat")
    callgrind_annotate --threshold=100 "$file" | awk -v cell="$cell" -v req="$requests" -v blocks="$blocks" '
        /PROGRAM TOTALS/ { gsub(",", "", $1); total = $1 }
        /malloc\.c:|arena\.c:|__rdl_(alloc|dealloc|realloc)|__rust_(alloc|dealloc|realloc)/ {
            n = $1; gsub(",", "", n); alloc += n
        }
        END { printf "%-22s %14d %14d %9.0f%% %12.1f\n", cell, total / req, alloc / req, 100 * alloc / total, blocks / req }'
done

if [ -n "${DATABASE_URL:-}" ]; then
    echo
    printf '%-22s %14s %14s\n' cell "instr/request" "SHA-256"
    for cell in "hand-written replay" "idem postgres replay" "hand-written first" "idem postgres first"; do
        counts=()
        for n in 300 600; do
            file="$out/callgrind.$(echo "$cell" | tr ' ' '-').$n.out"
            valgrind --tool=callgrind --callgrind-out-file="$file" \
                target/release/bench --cpu "$n" --only "$cell" >/dev/null 2>&1
            counts+=("$(callgrind_annotate --threshold=100 "$file" | awk '
                /PROGRAM TOTALS/ { gsub(",", "", $1); total = $1 }
                /sha2::sha256::compress256/ { n = $1; gsub(",", "", n); sha += n }
                END { printf "%d %d", total, sha }')")
        done
        read -r t1 s1 <<<"${counts[0]}"
        read -r t2 s2 <<<"${counts[1]}"
        printf '%-22s %14d %14d\n' "$cell" $(((t2 - t1) / 1500)) $(((s2 - s1) / 1500))
    done
fi
