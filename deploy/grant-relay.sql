-- What the relay's role needs, and nothing more (what `pgoutbox migrate --grant-relay ROLE` runs).
-- Replace public/outbox/pgoutbox_relay with your schema, table and role. Run as the table owner.
GRANT USAGE ON SCHEMA public TO pgoutbox_relay;
GRANT SELECT, UPDATE, DELETE ON public.outbox TO pgoutbox_relay;   -- DELETE: retention 0 and cleanup
GRANT SELECT ON public.pgoutbox_migrations TO pgoutbox_relay;       -- schema version check at start

-- Producers (what `pgoutbox migrate --grant-producer ROLE` runs):
GRANT USAGE ON SCHEMA public TO app;
GRANT INSERT ON public.outbox TO app;
GRANT EXECUTE ON FUNCTION public.outbox_enqueue(text, jsonb, text, jsonb) TO app;
