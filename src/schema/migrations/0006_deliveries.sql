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
