-- What the relay needs on top of the minimal table. Every column has a default, so a plain
-- `INSERT INTO outbox (topic, payload) VALUES (...)` from any language keeps working.
ALTER TABLE {outbox}
    -- Insert order: per-key ordering and cleanup walk it. Existing rows are numbered when added.
    ADD COLUMN IF NOT EXISTS seq bigint GENERATED ALWAYS AS IDENTITY,
    -- Message key: per-key ordering, Kafka/NATS keys.
    ADD COLUMN IF NOT EXISTS key text,
    ADD COLUMN IF NOT EXISTS headers jsonb NOT NULL DEFAULT '{}',
    -- When the row is next due: insert time, a backoff, or a lease expiry.
    ADD COLUMN IF NOT EXISTS next_attempt_at timestamptz NOT NULL DEFAULT now(),
    -- The destination that last handled the row (for status and dead-letter filters).
    ADD COLUMN IF NOT EXISTS destination text,
    -- Set when the row is dead-lettered; such a row is never claimed until redriven.
    ADD COLUMN IF NOT EXISTS dead_at timestamptz,
    -- Lease mode: the claim's fencing token.
    ADD COLUMN IF NOT EXISTS lease_token uuid;

-- The minimal design may have left these loose; the relay relies on them.
UPDATE {outbox} SET attempts = 0 WHERE attempts IS NULL;
ALTER TABLE {outbox}
    ALTER COLUMN attempts SET DEFAULT 0,
    ALTER COLUMN attempts SET NOT NULL,
    ALTER COLUMN created_at SET DEFAULT now(),
    ALTER COLUMN headers SET DEFAULT '{}';

-- Pending rows of an upgraded table are due from their creation time, so they keep their order.
UPDATE {outbox} SET next_attempt_at = created_at
WHERE published_at IS NULL AND created_at IS NOT NULL AND next_attempt_at > created_at;

-- Serves the claim (OutboxClaimDue): only pending, live rows, ordered by due time. Published and
-- dead rows leave it, so claim cost does not grow with history.
CREATE INDEX IF NOT EXISTS {name:pending_idx} ON {outbox} (next_attempt_at, seq)
    WHERE published_at IS NULL AND dead_at IS NULL;

-- Cleanup walks the table in seq order, in short bounded batches.
CREATE UNIQUE INDEX IF NOT EXISTS {name:seq_idx} ON {outbox} (seq);

-- Dead-letter listing and dead retention, without scanning the table.
CREATE INDEX IF NOT EXISTS {name:dead_idx} ON {outbox} (dead_at) WHERE dead_at IS NOT NULL;
