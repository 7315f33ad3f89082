-- The well-known minimal outbox table. Created only when absent: an application that already has
-- it keeps its rows, and migration 2 upgrades it in place.
CREATE TABLE IF NOT EXISTS {outbox} (
    id           uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    created_at   timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz,
    topic        text NOT NULL,
    payload      jsonb NOT NULL,
    attempts     int NOT NULL DEFAULT 0,
    last_error   text
);
