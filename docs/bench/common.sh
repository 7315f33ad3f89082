# Sourced by the scripts here: settings, a scratch directory, and a fresh database `$DB` with the
# pgoutbox schema, both removed on exit.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-target/release/pgoutbox}
PGURL=${PGURL:-postgres://postgres@127.0.0.1}
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"; psql -q "$PGURL/postgres" -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" 2>/dev/null' EXIT
# The single-row INSERT any application writes.
echo "INSERT INTO outbox (topic, payload) VALUES ('order.created', '{\"order_id\": 42, \"total\": 19.99}');" > "$DIR/insert.sql"

# Drops and creates `$DB`; with `pgoutbox`, runs `pgoutbox migrate` on it.
fresh_database() {
  psql -q "$PGURL/postgres" -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" 2>/dev/null
  psql -q "$PGURL/postgres" -c "CREATE DATABASE $DB"
  if [ "${1:-}" = pgoutbox ]; then
    "$BIN" migrate --database-url "$PGURL/$DB" >/dev/null 2>&1
  fi
}
