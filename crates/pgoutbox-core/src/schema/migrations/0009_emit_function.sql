-- For producers that want no table write at all (`source = "wal"` relays only): the event is a
-- transactional logical decoding message, so it reaches the WAL reader if and only if the caller's
-- transaction commits, in commit order, and costs the caller no row, index entry or vacuum.
-- The trade-off: until a relay delivers it, such an event lives only in the WAL behind the
-- replication slot; a polling relay never sees it, and a dropped slot loses it.
-- The prefix names the table, so relays of other outbox tables in the same database skip it.
CREATE OR REPLACE FUNCTION {qname:emit}(
    p_topic text, p_payload jsonb, p_key text DEFAULT NULL, p_headers jsonb DEFAULT '{}'
) RETURNS uuid LANGUAGE plpgsql AS $$
DECLARE
    v_id uuid := gen_random_uuid();
BEGIN
    IF p_topic IS NULL OR p_payload IS NULL THEN
        RAISE EXCEPTION '{qname:emit}: topic and payload must not be NULL';
    END IF;
    PERFORM pg_logical_emit_message(true, '{prefix}', json_build_object(
        'id', v_id, 'topic', p_topic, 'key', p_key, 'payload', p_payload,
        'headers', coalesce(p_headers, '{}'), 'created_at', now())::text);
    RETURN v_id;
END $$;
