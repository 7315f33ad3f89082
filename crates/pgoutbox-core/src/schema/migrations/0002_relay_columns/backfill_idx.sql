-- Temporary: the rows still to number, in creation order, so each numbering batch is a short
-- index range scan from where the previous one stopped. Dropped once all are numbered.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {name:seq_backfill_idx}
    ON {outbox} ((coalesce(created_at, '-infinity')), id) WHERE seq IS NULL
