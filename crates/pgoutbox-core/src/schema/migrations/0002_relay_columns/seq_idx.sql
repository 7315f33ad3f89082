-- Cleanup walks the table in seq order, in short bounded batches; the numbering of existing rows
-- finds its last numbered row with it, and it guarantees no number is given twice. Rows not yet
-- numbered (NULL) are not in conflict with each other.
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS {name:seq_idx} ON {outbox} (seq)
