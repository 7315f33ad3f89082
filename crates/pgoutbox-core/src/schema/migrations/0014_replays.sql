-- Replays: retained events sent again to one destination (`pgoutbox replay`, the console,
-- `backfill`). A replay is a row, so it survives restarts and any relay serving its destination
-- drives it: one short transaction at a time locks the row, copies the next events after its
-- cursor into the deliveries table as pairs of that destination, and moves the cursor on. Each
-- event is queued once per replay; the destination's lane delivers the pairs like any other.
CREATE TABLE IF NOT EXISTS {qname:replays} (
    id          uuid PRIMARY KEY,
    destination text NOT NULL,
    -- What it sends: events created in [since, until), of these topics and keys (NULL: any),
    -- for which the CEL filter is true, published before the replay was created (`upto`).
    since       timestamptz,
    until       timestamptz,
    topics      text[],
    keys        text[],
    filter      text,
    upto        timestamptz NOT NULL,
    -- Its own rate ("500/s"), taken from a bucket of its own; NULL: as fast as the lane takes it.
    rate        text,
    -- A destination's `backfill`, created once when the destination first appears.
    backfill    boolean NOT NULL DEFAULT false,
    state       text NOT NULL DEFAULT 'running'
                CHECK (state IN ('running', 'paused', 'cancelled', 'done', 'failed')),
    -- Where the walk of the retained events is: the last (published_at, seq, id) read.
    cursor_at   timestamptz,
    cursor_seq  bigint,
    cursor_id   uuid,
    -- Events in its range when it was created; read and queued so far.
    total       bigint NOT NULL DEFAULT 0,
    read        bigint NOT NULL DEFAULT 0,
    queued      bigint NOT NULL DEFAULT 0,
    walked      boolean NOT NULL DEFAULT false,
    error       text,
    created_by  text NOT NULL DEFAULT current_user,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz
);
-- One backfill per destination, ever.
CREATE UNIQUE INDEX IF NOT EXISTS {name:replays_backfill_idx} ON {qname:replays} (destination)
    WHERE backfill;
-- A replayed pair names its replay, so its progress counts what is still queued.
ALTER TABLE {qname:deliveries} ADD COLUMN IF NOT EXISTS replay_id uuid;
CREATE INDEX IF NOT EXISTS {name:deliveries_replay_idx} ON {qname:deliveries} (replay_id, dead_at)
    WHERE replay_id IS NOT NULL;
