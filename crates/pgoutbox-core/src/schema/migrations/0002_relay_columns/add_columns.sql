-- What the relay needs on top of the minimal table. Every column has a default, so a plain
-- `INSERT INTO outbox (topic, payload) VALUES (...)` from any language keeps working.
--
-- Metadata only, whatever the table's size: nullable columns, and NOT NULL columns with a
-- non-volatile default (PostgreSQL 11+ stores it once in the catalog instead of rewriting rows).
-- Takes ACCESS EXCLUSIVE for a few milliseconds (under the runner's lock timeout).
ALTER TABLE {outbox}
    -- Insert order: per-key ordering and cleanup walk it. Nullable for now: existing rows are
    -- numbered in batches (number_rows.sql), then it becomes NOT NULL and an identity.
    ADD COLUMN IF NOT EXISTS seq bigint,
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
    ADD COLUMN IF NOT EXISTS lease_token uuid,
    -- The minimal design may have left these loose; the relay relies on them.
    ALTER COLUMN attempts SET DEFAULT 0,
    ALTER COLUMN created_at SET DEFAULT now(),
    ALTER COLUMN headers SET DEFAULT '{}';

-- Rows inserted from now on are numbered by this sequence, so they all come after the existing
-- rows (which get negative numbers). Replaced by the column's identity at the end (identity.sql).
CREATE SEQUENCE IF NOT EXISTS {qname:seq_tmp} AS bigint;
ALTER TABLE {outbox} ALTER COLUMN seq SET DEFAULT nextval('{qname:seq_tmp}');
