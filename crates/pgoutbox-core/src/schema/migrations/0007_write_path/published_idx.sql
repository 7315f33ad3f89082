-- Cleanup (OutboxDeletePublished) walks the published rows oldest first. Only published rows are
-- in it, so an INSERT (a pending row) never touches it: it replaces the unique index on `seq`,
-- which every INSERT paid for. Empty in delete mode.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {name:published_idx} ON {outbox} (published_at)
    WHERE published_at IS NOT NULL
