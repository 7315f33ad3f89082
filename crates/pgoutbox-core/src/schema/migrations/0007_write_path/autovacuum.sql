-- The outbox's own autovacuum settings: every settle leaves a dead row version and dead entries in
-- the claim index, so the table wants vacuum far earlier than the default 20 % of its rows.
-- Only the settings the table does not set already (an operator's own tuning is kept). Changing
-- autovacuum reloptions takes SHARE UPDATE EXCLUSIVE: inserts and settles go on.
DO $$
DECLARE
    current text[] := coalesce((SELECT reloptions FROM pg_class WHERE oid = '{outbox}'::regclass), '{}');
    wanted text[] := ARRAY['autovacuum_vacuum_scale_factor=0.01', 'autovacuum_vacuum_threshold=1000',
                           'autovacuum_vacuum_insert_scale_factor=0.01', 'autovacuum_vacuum_cost_delay=0',
                           'autovacuum_analyze_scale_factor=0.02'];
    o text;
BEGIN
    FOREACH o IN ARRAY wanted LOOP
        IF NOT EXISTS (SELECT FROM unnest(current) c WHERE split_part(c, '=', 1) = split_part(o, '=', 1)) THEN
            EXECUTE format('ALTER TABLE {outbox} SET (%s)', o);
        END IF;
    END LOOP;
END $$;
