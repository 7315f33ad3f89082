#!/bin/bash
# Commit→publish with pgbench producers: 8 clients at 3,000 commits/s (`-R`) for 20 s, the relay
# writing to the stdout sink, read by another process (tail-reader.py) that takes
# latency = arrival − the event's timestamp (its insert time). The relay idles IDLE seconds first,
# as a relay between bursts does. Needs pgbench, python3 and a release build.
#
#   docs/bench/tail-pgbench.sh
IDLE=${IDLE:-3}
DB=pgoutbox_tail
source "$(dirname "$0")/common.sh"
fresh_database pgoutbox
printf 'database_url = "%s"\nretention = "0s"\n[[destinations]]\nname = "out"\ntype = "stdout"\n' "$PGURL/$DB" > "$DIR/relay.toml"
( "$BIN" relay --config "$DIR/relay.toml" 2>/dev/null | python3 docs/bench/tail-reader.py > "$DIR/latency.txt" ) &
sleep "$IDLE"
pgbench -n -c 8 -j 2 -R 3000 -T 20 -M simple -f "$DIR/insert.sql" "$PGURL/$DB" 2>/dev/null | grep -E "^tps"
sleep 2
pkill -INT -f "relay --config $DIR/relay.toml" || true
wait
cat "$DIR/latency.txt"
