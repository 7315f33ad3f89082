-- Each rate-limited destination's token bucket, shared by every relay of this outbox: a relay
-- takes a few tokens at a time (one statement, the row lock orders the takers), so the limit
-- holds for the destination however many relays serve it. A few rows, updated often: HOT
-- updates (no index but the key) and room in each page for them.
CREATE TABLE IF NOT EXISTS {qname:rates} (
    destination text PRIMARY KEY,
    -- Tokens left when `at` was last written (fractional: refilled at the rate per second).
    tokens      float8 NOT NULL,
    at          timestamptz NOT NULL,
    -- What the last take got (the statement returns it: the new row is all RETURNING sees).
    granted     int NOT NULL DEFAULT 0
) WITH (fillfactor = 50, autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);
