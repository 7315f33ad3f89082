#!/bin/bash
# What a WAL reader costs the application's commits, with pgbench as the issue measured it: 32
# clients committing single-row transactions (simple protocol), ROUNDS rounds of T seconds, each
# setting once per round in rotating order, on a fresh database after a CHECKPOINT:
#   none     the pgoutbox table, no slot, no reader (the reference)
#   relay    the same while `pgoutbox relay` (source = "wal", null sink) streams the slot
#   recv     the same while pg_recvlogical (pgoutput) streams the slot to /dev/null: the floor
#            any logical decoding client pays
# With PRODUCER=emit the clients call outbox_emit() instead, against plain INSERTs into the
# article's minimal table with no reader (`minimal`). SETTINGS picks the settings (the first is
# the reference); `relay@5ms` is the relay with `wal.batch_wait = "5ms"`, `relay/1` the relay
# with `relay.workers = 1` (one batch in flight at a time), `relay-delete` the relay with
# `retention = "0s"` (delivered rows deleted instead of marked published). Prints every run and
# the median ratios.
# With RATE=N the clients commit N transactions/s (pgbench -R) and each run reports instead the
# whole machine's busy CPU per 1,000 commits (ms, from /proc/stat: producers, server and reader):
# at a rate both settings hold, a reader's cost shows as CPU rather than as lost commits, which a
# saturated machine makes noisy. The summary then gives each setting's median extra CPU.
# Needs a server with wal_level = logical, pgbench, pg_recvlogical and a release build.
#
#   PGURL=postgres://postgres@127.0.0.1:5499 docs/bench/wal-cost.sh
#   PGURL=... PRODUCER=emit ROUNDS=5 T=10 docs/bench/wal-cost.sh
ROUNDS=${ROUNDS:-3}
T=${T:-10}
PRODUCER=${PRODUCER:-insert}
DB=pgoutbox_wal_cost
SLOT=pgoutbox_wal_cost
source "$(dirname "$0")/common.sh"
RECV=${RECV:-$(ls /usr/lib/postgresql/*/bin/pg_recvlogical 2>/dev/null | tail -n1)}
[ -x "$RECV" ] || { echo "pg_recvlogical not found (set RECV)" >&2; exit 1; }
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$DIR"; drop_slot; psql -q "$PGURL/postgres" -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" 2>/dev/null' EXIT
echo "SELECT outbox_emit('order.created', '{\"order_id\": 42, \"total\": 19.99}');" > "$DIR/emit.sql"

drop_slot() {
  psql -qAt "$PGURL/postgres" -c "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = '$SLOT'" >/dev/null 2>&1 || true
}
wait_active() { # pid of the reader
  for _ in $(seq 1 300); do
    [ "$(psql -qAt "$PGURL/$DB" -c "SELECT active FROM pg_replication_slots WHERE slot_name = '$SLOT'")" = t ] && return 0
    kill -0 "$1" 2>/dev/null || { echo "the reader stopped before streaming" >&2; return 1; }
    sleep 0.1
  done
  echo "the reader did not stream within 30 s" >&2; return 1
}
# CPU time spent by the whole machine so far, in clock ticks (user, nice, system, irq, softirq).
busy_jiffies() { awk '/^cpu / {print $2 + $3 + $4 + $7 + $8}' /proc/stat; }
run() { # setting -> commits/s (with RATE: busy CPU ms per 1,000 commits)
  local script="$DIR/insert.sql" reader=""
  drop_slot
  if [ "$1" = minimal ]; then
    fresh_database
    psql -q "$PGURL/$DB" -c "CREATE TABLE outbox (id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
      created_at timestamptz NOT NULL DEFAULT now(), published_at timestamptz, topic text NOT NULL,
      payload jsonb NOT NULL, attempts int NOT NULL DEFAULT 0, last_error text)"
  else
    fresh_database pgoutbox
    [ "$PRODUCER" = emit ] && script="$DIR/emit.sql"
  fi
  case "$1" in
    relay*)
      local wait="" workers="" retention=""
      [[ "$1" == relay@* ]] && wait="batch_wait = \"${1#relay@}\""
      [[ "$1" == relay/* ]] && workers="${1#relay/}"
      [ "$1" = relay-delete ] && retention='retention = "0s"'
      printf 'database_url = "%s"\nsource = "wal"\n%s\n[wal]\nslot = "%s"\n%s\n[[destinations]]\nname = "null"\ntype = "null"\n' \
        "$PGURL/$DB" "$retention" "$SLOT" "$wait" > "$DIR/relay.toml"
      "$BIN" slot create -c "$DIR/relay.toml" >/dev/null 2>&1
      PGOUTBOX_WORKERS=${workers:-2} "$BIN" relay -c "$DIR/relay.toml" 2>"$DIR/relay.log" &
      reader=$!
      ;;
    recv)
      printf 'database_url = "%s"\nsource = "wal"\n[wal]\nslot = "%s"\n' "$PGURL/$DB" "$SLOT" > "$DIR/relay.toml"
      "$BIN" slot create -c "$DIR/relay.toml" >/dev/null 2>&1
      "$RECV" -d "$PGURL/$DB" --slot "$SLOT" --start -o proto_version=1 -o publication_names=pgoutbox_outbox \
        -o messages=true -f /dev/null 2>/dev/null &
      reader=$!
      ;;
  esac
  [ -n "$reader" ] && { wait_active "$reader"; sleep 0.3; }
  psql -q "$PGURL/$DB" -c "CHECKPOINT"
  if [ -n "${RATE:-}" ]; then
    local before after out
    before=$(busy_jiffies)
    out=$(pgbench -n -c 32 -j 2 -T "$T" -R "$RATE" -M simple -f "$script" "$PGURL/$DB" 2>/dev/null)
    after=$(busy_jiffies)
    local commits
    commits=$(grep -oP 'transactions actually processed: \K[0-9]+' <<< "$out")
    echo "scale=1; ($after - $before) * 1000 / $(getconf CLK_TCK) * 1000 / $commits" | bc
  else
    pgbench -n -c 32 -j 2 -T "$T" -M simple -f "$script" "$PGURL/$DB" 2>/dev/null | grep -oP 'tps = \K[0-9]+' | head -1
  fi
  if [ -n "$reader" ]; then kill "$reader"; wait "$reader" 2>/dev/null || true; fi
}

if [ -n "${SETTINGS:-}" ]; then read -ra settings <<< "$SETTINGS"
elif [ "$PRODUCER" = emit ]; then settings=(minimal none relay recv)
else settings=(none relay recv); fi
declare -A rates
n=${#settings[@]}
for r in $(seq 0 $((ROUNDS - 1))); do
  line="round $((r + 1)):"
  for k in $(seq 0 $((n - 1))); do
    s=${settings[$(((r + k) % n))]}
    rates[$s]+="$(run "$s") "
  done
  for s in "${settings[@]}"; do line+=" $s $(echo ${rates[$s]} | awk '{print $NF}')"; done
  echo "$line"
done
median() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
ref=${settings[0]}
read -ra base <<< "${rates[$ref]}"
for s in "${settings[@]:1}"; do
  read -ra got <<< "${rates[$s]}"
  ratios=()
  if [ -n "${RATE:-}" ]; then
    for i in "${!got[@]}"; do ratios+=("$(echo "${got[$i]} - ${base[$i]}" | bc)"); done
    echo "$s vs $ref: median extra CPU $(median "${ratios[@]}") ms per 1,000 commits (${ratios[*]})"
    continue
  fi
  for i in "${!got[@]}"; do ratios+=("$(echo "scale=3; ${got[$i]} / ${base[$i]}" | bc | sed 's/^\./0./')"); done
  echo "$s vs $ref: median $(median "${ratios[@]}") (${ratios[*]})"
done
