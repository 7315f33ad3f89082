-- Dead-letter listing and dead retention, without scanning the table.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {name:dead_idx} ON {outbox} (dead_at) WHERE dead_at IS NOT NULL
