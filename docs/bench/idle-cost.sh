#!/bin/bash
# What an idle relay costs: CPU of the relay process and of its PostgreSQL backends over 30 s on
# an empty outbox (null sink), for one `poll_interval` (default: the relay's own default).
# Reads /proc, so run it on the database's machine. Needs a release build.
#
#   docs/bench/idle-cost.sh            # the default poll_interval
#   docs/bench/idle-cost.sh 100ms
DB=pgoutbox_idle
source "$(dirname "$0")/common.sh"
fresh_database pgoutbox
{
  printf 'database_url = "%s"\n' "$PGURL/$DB"
  [ -n "${1:-}" ] && printf '[relay]\npoll_interval = "%s"\n' "$1"
  printf '[[destinations]]\nname = "out"\ntype = "null"\n'
} > "$DIR/relay.toml"
"$BIN" relay --config "$DIR/relay.toml" 2>/dev/null &
relay=$!
sleep 5
ticks() { awk '{s += $14 + $15} END {print s}' "$@"; }
backends=$(psql -At "$PGURL/postgres" -c "SELECT pid FROM pg_stat_activity WHERE datname = '$DB'" | sed 's|.*|/proc/&/stat|')
relay_before=$(ticks /proc/$relay/stat); all_before=$(ticks /proc/$relay/stat $backends)
sleep 30
relay_after=$(ticks /proc/$relay/stat); all_after=$(ticks /proc/$relay/stat $backends)
kill -INT $relay; wait $relay || true
hz=$(getconf CLK_TCK)
echo "poll_interval ${1:-default}: relay $(echo "scale=2; ($relay_after - $relay_before) * 100 / $hz / 30" | bc) % CPU," \
     "relay and its backends $(echo "scale=2; ($all_after - $all_before) * 100 / $hz / 30" | bc) % CPU (of one core)"
