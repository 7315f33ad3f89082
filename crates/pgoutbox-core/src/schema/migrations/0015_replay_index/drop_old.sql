-- The indexes on published_at alone: the new ones lead with it (cleanup, EventSearch). A
-- partitioned index cannot be dropped concurrently: this one takes its brief exclusive lock under
-- the DDL lock timeout, retried (the runner).
DROP INDEX IF EXISTS {qname:history_published_idx}
