-- Serves the claim (OutboxClaimDue): only pending, live rows, ordered by due time. Published and
-- dead rows leave it, so claim cost does not grow with history.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {name:pending_idx} ON {outbox} (next_attempt_at, seq)
    WHERE published_at IS NULL AND dead_at IS NULL
