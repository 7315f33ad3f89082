-- What the relay's role needs, and nothing more (what `pgoutbox migrate --grant-relay ROLE` runs).
-- Replace public/outbox/pgoutbox_relay with your schema, table and role. Run as the table owner.
GRANT USAGE ON SCHEMA public TO pgoutbox_relay;
GRANT SELECT, UPDATE, DELETE ON public.outbox TO pgoutbox_relay;   -- DELETE: retention 0 and cleanup
GRANT SELECT, INSERT, UPDATE, DELETE ON public.outbox_destinations TO pgoutbox_relay;  -- pause, breaker
GRANT SELECT, INSERT, UPDATE, DELETE ON public.outbox_definitions TO pgoutbox_relay;   -- destinations at runtime
GRANT SELECT, UPDATE ON public.outbox_definitions_version TO pgoutbox_relay;           -- (the console changes them)
GRANT SELECT, INSERT, UPDATE ON public.outbox_rates TO pgoutbox_relay;                 -- rate_limit buckets
GRANT SELECT, INSERT, UPDATE ON public.outbox_replays TO pgoutbox_relay;               -- replays and backfills
GRANT SELECT, INSERT, UPDATE, DELETE ON public.outbox_deliveries TO pgoutbox_relay;    -- fan-out pairs
GRANT SELECT, INSERT, UPDATE, DELETE ON public.outbox_held_batches TO pgoutbox_relay;
GRANT USAGE ON SEQUENCE public.outbox_held_batches_id_seq TO pgoutbox_relay;
GRANT SELECT, INSERT, DELETE ON public.outbox_attempts TO pgoutbox_relay;              -- failed attempts
GRANT SELECT, INSERT, DELETE ON public.outbox_history TO pgoutbox_relay;  -- history = "partitions"
GRANT SELECT, INSERT, DELETE ON public.outbox_samples TO pgoutbox_relay;  -- the console's chart
GRANT SELECT, INSERT ON public.outbox_audit TO pgoutbox_relay;           -- operators' changes
GRANT SELECT ON public.pgoutbox_migrations TO pgoutbox_relay;       -- schema version check at start
-- With history = "partitions", partitions are created and dropped by the history's owner only:
-- run `pgoutbox cleanup` as the owner every few minutes (cron, systemd timer).

-- Producers (what `pgoutbox migrate --grant-producer ROLE` runs):
GRANT USAGE ON SCHEMA public TO app;
GRANT INSERT ON public.outbox TO app;
GRANT EXECUTE ON FUNCTION public.outbox_enqueue(text, jsonb, text, jsonb) TO app;
