-- Per-key ordering (OutboxClaimDueOrdered): "is there an earlier unsettled row of this key?" is one
-- probe of this index. Only keyed, unpublished rows are in it, so it stays small and costs nothing
-- for events without a key. Built concurrently: inserts go on meanwhile.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {name:key_idx} ON {outbox} (key, seq)
    WHERE key IS NOT NULL AND published_at IS NULL
