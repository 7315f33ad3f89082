-- Per-destination state that every relay of this outbox shares: the operator's pause and the
-- circuit breaker. A few rows (one per destination), read by each relay about once a second.
CREATE TABLE IF NOT EXISTS {qname:destinations} (
    name          text PRIMARY KEY,
    -- Set by `pgoutbox destination pause`: the destination's events are held until resumed.
    paused_at     timestamptz,
    -- closed: events flow; open: the destination is failing, its events are held and only
    -- probes go out; half_open: one relay is probing it now.
    breaker       text NOT NULL DEFAULT 'closed' CHECK (breaker IN ('closed', 'open', 'half_open')),
    breaker_since timestamptz NOT NULL DEFAULT now(),
    -- The failure that opened the breaker, or the last failed probe.
    last_error    text,
    -- Probes failed in a row since the breaker opened (the probe interval doubles with each).
    failed_probes int NOT NULL DEFAULT 0,
    -- Open: when the next probe may go. Half-open: when the probe counts as lost (its relay died).
    probe_at      timestamptz,
    -- Ordered with on_dead = "block": a dead event of this destination holds back its key.
    dead_blocks   boolean NOT NULL DEFAULT false,
    updated_at    timestamptz NOT NULL DEFAULT now()
);
