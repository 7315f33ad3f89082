-- What operators did: one row per change made through the console or the CLI (retry, discard,
-- pause, resume, replay): who (a token's name, or the CLI's user), what (the filter), how many,
-- when. Written after the change, read newest first by the console and `pgoutbox audit`.
CREATE TABLE IF NOT EXISTS {qname:audit} (
    id      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at      timestamptz NOT NULL DEFAULT now(),
    who     text NOT NULL,
    via     text NOT NULL,
    action  text NOT NULL,
    filter  jsonb NOT NULL DEFAULT '{}',
    matched bigint NOT NULL
);

-- The console's chart, shared by every relay of the deployment and kept across restarts: each
-- relay writes one sample per gauge interval and deletes its samples older than an hour, so the
-- table holds about an hour of samples per relay.
CREATE TABLE IF NOT EXISTS {qname:samples} (
    at          timestamptz NOT NULL,
    relay       text NOT NULL,
    lag_seconds float8 NOT NULL,
    pending     bigint NOT NULL,
    delivered   jsonb NOT NULL DEFAULT '{}',
    PRIMARY KEY (at, relay)
);
ALTER TABLE {qname:samples} SET (autovacuum_vacuum_scale_factor = 0.05);
