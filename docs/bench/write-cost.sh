#!/bin/bash
# What the outbox costs the application's commits, with pgbench: the pgoutbox table (as
# `pgoutbox migrate` makes it) against the article's minimal table, 32 clients committing
# single-row `INSERT INTO outbox (topic, payload)` (simple protocol, as any language sends it),
# each run on a fresh database after a CHECKPOINT, PAIRS pairs of T seconds, alternating.
# Prints each pair and the median ratio. Needs pgbench and a release build.
#
#   docs/bench/write-cost.sh                 # PAIRS=3 T=15
#   PAIRS=5 T=10 PGURL=postgres://postgres@127.0.0.1 docs/bench/write-cost.sh
PAIRS=${PAIRS:-3}
T=${T:-15}
DB=pgoutbox_write_cost
source "$(dirname "$0")/common.sh"

run() { # kind -> commits/s
  fresh_database "$1"
  if [ "$1" = minimal ]; then
    psql -q "$PGURL/$DB" -c "CREATE TABLE outbox (id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
      created_at timestamptz NOT NULL DEFAULT now(), published_at timestamptz, topic text NOT NULL,
      payload jsonb NOT NULL, attempts int NOT NULL DEFAULT 0, last_error text)"
  fi
  psql -q "$PGURL/$DB" -c "CHECKPOINT"
  pgbench -n -c 32 -j 2 -T "$T" -M simple -f "$DIR/insert.sql" "$PGURL/$DB" 2>/dev/null | grep -oP 'tps = \K[0-9]+' | head -1
}

ratios=()
for i in $(seq 1 "$PAIRS"); do
  minimal=$(run minimal)
  pgoutbox=$(run pgoutbox)
  ratio=$(echo "scale=3; $pgoutbox / $minimal" | bc | sed "s/^\./0./")
  ratios+=("$ratio")
  echo "pair $i: pgoutbox $pgoutbox / minimal $minimal commits/s = $ratio"
done
echo "median ratio: $(printf '%s\n' "${ratios[@]}" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')"
