-- Time-ordered ids for producers that leave `id` out, where the server makes them for free:
-- PostgreSQL 18's built-in uuidv7(). New ids then land at the right edge of the primary key instead
-- of on a random leaf page (after a checkpoint, one full-page image per leaf touched). On 13 to 17
-- the default stays gen_random_uuid(): every UUIDv7 expression or function measured there cost
-- plain-SQL producers 15-25 % of their commits (the default is re-read and re-planned on every
-- unprepared INSERT), more than the index locality gives back (docs/performance.md, "Write path").
-- The Rust enqueue adapters send UUIDv7 ids themselves on every version. A default the operator
-- chose is kept. Metadata only: ACCESS EXCLUSIVE for a few milliseconds, under the lock timeout.
DO $$
BEGIN
    IF current_setting('server_version_num')::int >= 180000
       AND (SELECT pg_get_expr(d.adbin, d.adrelid) FROM pg_attrdef d
            JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
            WHERE d.adrelid = '{outbox}'::regclass AND a.attname = 'id') = 'gen_random_uuid()' THEN
        EXECUTE 'ALTER TABLE {outbox} ALTER COLUMN id SET DEFAULT uuidv7()';
    END IF;
END $$;
