-- DeliveriesClaim, per destination: each destination's lane claims its own due pairs, oldest first,
-- so a destination with a long backlog never stands in front of another's retries. Also serves the
-- held pairs of one destination ('infinity'): its probe, max_age, and release when it is back.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {name:deliveries_lane_idx}
    ON {qname:deliveries} (destination, next_attempt_at, seq) WHERE dead_at IS NULL
