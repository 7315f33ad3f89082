#!/bin/bash
# What the outbox costs the application's commits, with pgbench: the pgoutbox table (as
# `pgoutbox migrate` makes it) against the article's minimal table, 32 clients committing
# single-row `INSERT INTO outbox (topic, payload)` (simple protocol, as any language sends it),
# each run on a fresh database after a CHECKPOINT, PAIRS pairs of T seconds, alternating.
# Prints each pair and the median ratio. Needs pgbench and a release build.
#
#   docs/bench/write-cost.sh                 # PAIRS=3 T=15
#   PAIRS=5 T=10 PGURL=postgres://postgres@127.0.0.1 docs/bench/write-cost.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-target/release/pgoutbox}
PGURL=${PGURL:-postgres://postgres@127.0.0.1}
PAIRS=${PAIRS:-3}
T=${T:-15}
DB=pgoutbox_write_cost
SQL=$(mktemp)
trap 'rm -f "$SQL"; psql -q "$PGURL/postgres" -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" 2>/dev/null' EXIT
echo "INSERT INTO outbox (topic, payload) VALUES ('order.created', '{\"order_id\": 42, \"total\": 19.99}');" > "$SQL"

run() { # kind -> commits/s
  psql -q "$PGURL/postgres" -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" 2>/dev/null
  psql -q "$PGURL/postgres" -c "CREATE DATABASE $DB"
  if [ "$1" = minimal ]; then
    psql -q "$PGURL/$DB" -c "CREATE TABLE outbox (id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
      created_at timestamptz NOT NULL DEFAULT now(), published_at timestamptz, topic text NOT NULL,
      payload jsonb NOT NULL, attempts int NOT NULL DEFAULT 0, last_error text)"
  else
    "$BIN" migrate --database-url "$PGURL/$DB" >/dev/null 2>&1
  fi
  psql -q "$PGURL/$DB" -c "CHECKPOINT"
  pgbench -n -c 32 -j 2 -T "$T" -M simple -f "$SQL" "$PGURL/$DB" 2>/dev/null | grep -oP 'tps = \K[0-9]+' | head -1
}

ratios=()
for i in $(seq 1 "$PAIRS"); do
  minimal=$(run minimal)
  pgoutbox=$(run pgoutbox)
  ratio=$(echo "scale=3; $pgoutbox / $minimal" | bc)
  ratios+=("$ratio")
  echo "pair $i: pgoutbox $pgoutbox / minimal $minimal commits/s = $ratio"
done
echo "median ratio: $(printf '%s\n' "${ratios[@]}" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')"
