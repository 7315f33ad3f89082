-- The consumer-side inbox: one row per (consumer, event) already applied. The primary key is the
-- dedup: a second INSERT of the same pair does nothing, and a concurrent one waits on the first
-- transaction's index entry until it commits (then does nothing) or rolls back (then inserts).
CREATE TABLE IF NOT EXISTS {inbox} (
    consumer     text NOT NULL,
    event_id     uuid NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);

-- Serves cleanup (InboxSelectExpired): oldest rows first, without scanning the table.
CREATE INDEX IF NOT EXISTS {processed_idx} ON {inbox} (processed_at);
