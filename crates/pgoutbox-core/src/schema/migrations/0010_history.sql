-- Published history in partitions (`history = "partitions"`): delivered events are moved here at
-- settle instead of being marked published in the outbox, and cleanup drops whole partitions once
-- they are older than `retention`. The outbox then holds only pending and dead rows, as with
-- `retention = "0s"`, and the history leaves no dead tuples, no vacuum work and no index creep
-- behind (docs/performance.md, "Soak"). Range-partitioned by `published_at`; the relay creates the
-- partitions ahead of time (src/history.rs). The default partition only catches rows published
-- while no partition covered the time (cleanup deletes those row by row). Empty and unused with
-- the default `history = "outbox"`.
CREATE TABLE IF NOT EXISTS {qname:history} (
    -- As loose as the outbox rows it takes: an upgraded minimal table may hold rows with no
    -- created_at, and a settle must never fail on what an application wrote.
    id           uuid NOT NULL,
    seq          bigint,
    topic        text,
    key          text,
    payload      jsonb,
    headers      jsonb,
    created_at   timestamptz,
    published_at timestamptz NOT NULL,
    -- The destination that took the event; NULL for a split event (its pairs were fanned out).
    destination  text,
    attempts     int,
    last_error   text
) PARTITION BY RANGE (published_at);
CREATE TABLE IF NOT EXISTS {qname:history_default} PARTITION OF {qname:history} DEFAULT;
-- EventShow: one event by id (no unique key: a partitioned table's must include published_at).
CREATE INDEX IF NOT EXISTS {name:history_id_idx} ON {qname:history} (id);
-- EventSearch, published newest first: an ordered append of each partition's index.
CREATE INDEX IF NOT EXISTS {name:history_published_idx} ON {qname:history} (published_at);
