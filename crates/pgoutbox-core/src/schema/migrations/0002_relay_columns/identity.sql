-- seq becomes what a fresh table has: GENERATED ALWAYS AS IDENTITY, continuing after the highest
-- number given (the identity's sequence starts at 1 like any identity; RESTART moves it on).
-- Metadata only (seq is NOT NULL already): ACCESS EXCLUSIVE for a few milliseconds. The temporary
-- sequence goes with it.
ALTER TABLE {outbox} ALTER COLUMN seq DROP DEFAULT;
ALTER TABLE {outbox} ALTER COLUMN seq ADD GENERATED ALWAYS AS IDENTITY;
DO $$
DECLARE
    next bigint;
BEGIN
    SELECT greatest(
               coalesce((SELECT max(seq) FROM {outbox}), 0),
               (SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {qname:seq_tmp})) + 1
    INTO next;
    EXECUTE format('ALTER TABLE {outbox} ALTER COLUMN seq RESTART WITH %s', coalesce(next, 1));
END
$$;
DROP SEQUENCE IF EXISTS {qname:seq_tmp};

