-- Attempt history, for the console and `dead show`: one row per failed attempt of an event at a
-- destination. A delivery writes nothing here, so a healthy relay pays nothing; a failing one
-- pays one small insert per failed event, in the same transaction as its settle. Cleanup deletes
-- rows older than `attempts_retention` (default 7 days) in short batches.
CREATE TABLE IF NOT EXISTS {qname:attempts} (
    event_id    uuid NOT NULL,
    destination text,
    at          timestamptz NOT NULL DEFAULT statement_timestamp(),
    error       text NOT NULL,
    dead        boolean NOT NULL DEFAULT false
);
-- One event's history, in order (EventShow).
CREATE INDEX IF NOT EXISTS {name:attempts_event_idx} ON {qname:attempts} (event_id, at);
-- Cleanup by age.
CREATE INDEX IF NOT EXISTS {name:attempts_at_idx} ON {qname:attempts} (at);
ALTER TABLE {qname:attempts} SET (autovacuum_vacuum_scale_factor = 0.02,
                                   autovacuum_analyze_scale_factor = 0.02);
