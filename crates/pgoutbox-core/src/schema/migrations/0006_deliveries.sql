-- Fan-out: the delivery state of (event, destination) pairs that did not deliver at their event's
-- first attempt (failed, held, dead, or waiting behind an earlier pair of their key). A row is a
-- copy of its event plus the pair's state, so it never needs the event row again; delivering the
-- pair deletes it, so the table holds only the current failures. See docs/design.md, "Fan-out".
CREATE TABLE IF NOT EXISTS {qname:deliveries} (
    event_id        uuid NOT NULL,
    destination     text NOT NULL,
    seq             bigint NOT NULL,
    topic           text NOT NULL,
    key             text,
    payload         jsonb NOT NULL,
    headers         jsonb NOT NULL DEFAULT '{}',
    created_at      timestamptz NOT NULL,
    attempts        int NOT NULL DEFAULT 0,
    -- Due time: backoff, lease expiry, or 'infinity' while the destination is held.
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    last_error      text,
    dead_at         timestamptz,
    lease_token     uuid,
    PRIMARY KEY (event_id, destination)
);
-- DeliveriesClaim: due pairs in order; 'infinity' holds the held ones.
CREATE INDEX IF NOT EXISTS {name:deliveries_due_idx} ON {qname:deliveries} (next_attempt_at, seq)
    WHERE dead_at IS NULL;
-- Per-destination key order: a key's earlier undelivered pair for the same destination.
CREATE INDEX IF NOT EXISTS {name:deliveries_key_idx} ON {qname:deliveries} (destination, key, seq)
    WHERE key IS NOT NULL;
-- Per-destination dead letters.
CREATE INDEX IF NOT EXISTS {name:deliveries_dead_idx} ON {qname:deliveries} (destination, dead_at)
    WHERE dead_at IS NOT NULL;
-- Rows come and go with failures: vacuum early, like the outbox (docs/operations.md, "Vacuum").
ALTER TABLE {qname:deliveries} SET (autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_threshold = 1000, autovacuum_vacuum_insert_scale_factor = 0.02);

-- Held pairs in bulk: while a destination is paused or its breaker is open, the pairs it cannot
-- take now are written one row per batch instead of one row each, so a destination that is down
-- costs the others little. `events` is the batch's events as one JSON array (written by the relay,
-- read back by DeliveriesUnbundle when the destination is back); `topics` counts them per topic for
-- `status` and the gauges. Only pairs that need no per-key order go here.
CREATE TABLE IF NOT EXISTS {qname:held_batches} (
    id          bigserial PRIMARY KEY,
    destination text NOT NULL,
    -- The oldest event's created_at (max_age).
    oldest      timestamptz NOT NULL,
    count       int NOT NULL,
    topics      jsonb NOT NULL,
    events      bytea NOT NULL
);
-- lz4 where the server has it (PostgreSQL 14+ built with lz4): a batch compresses about 4x for a
-- fraction of pglz's CPU; elsewhere stored uncompressed (pglz cost more than it saved).
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_settings WHERE name = 'default_toast_compression'
               AND 'lz4' = ANY(enumvals)) THEN
        EXECUTE 'ALTER TABLE {qname:held_batches} ALTER events SET COMPRESSION lz4';
    ELSE
        EXECUTE 'ALTER TABLE {qname:held_batches} ALTER events SET STORAGE EXTERNAL';
    END IF;
END $$;
CREATE INDEX IF NOT EXISTS {name:held_batches_destination_idx} ON {qname:held_batches} (destination, id);
