-- For producers that prefer a call to an INSERT: runs in the caller's transaction like any statement.
CREATE OR REPLACE FUNCTION {qname:enqueue}(
    p_topic text, p_payload jsonb, p_key text DEFAULT NULL, p_headers jsonb DEFAULT '{}'
) RETURNS uuid LANGUAGE sql AS $$
    INSERT INTO {outbox} (topic, payload, key, headers)
    VALUES (p_topic, p_payload, p_key, coalesce(p_headers, '{}'))
    RETURNING id
$$;
