-- One batch of the numbering of the rows that existed before seq (those with seq NULL), in
-- creation order (created_at, then id), with negative numbers: every existing row sorts before
-- every row inserted since (those take 1, 2, … from the sequence), and the last existing row gets
-- -1. The first batch starts at -(rows to number); each later batch continues from the last
-- numbered row, found through {name:seq_idx}, so a run killed between batches resumes exactly
-- there. The rows to number come from {name:seq_backfill_idx} (a range scan from that last row);
-- the UPDATE finds them by primary key. Pending rows are made due from their creation time, so
-- they keep their order behind any event inserted since.
-- $1: rows per batch; $2: the cursor (only a lower bound here). Returns (rows numbered, the last
-- number given), the number NULL when nothing was left.
WITH last AS (
    SELECT seq, coalesce(created_at, '-infinity') AS at, id FROM {outbox}
    WHERE seq < 0 AND seq >= $2
    ORDER BY seq DESC
    LIMIT 1
),
numbered AS (
    UPDATE {outbox} AS o
    SET seq = coalesce((SELECT seq FROM last),
                       -(SELECT count(*) FROM {outbox} WHERE seq IS NULL) - 1) + b.n,
        next_attempt_at = CASE WHEN o.published_at IS NULL AND o.created_at < o.next_attempt_at
                               THEN o.created_at ELSE o.next_attempt_at END
    FROM unnest(ARRAY(
        SELECT id FROM {outbox}
        WHERE seq IS NULL
          AND (coalesce(created_at, '-infinity'), id) >= (
                coalesce((SELECT at FROM last), '-infinity'),
                coalesce((SELECT id FROM last), '00000000-0000-0000-0000-000000000000'))
        ORDER BY coalesce(created_at, '-infinity'), id
        LIMIT $1)) WITH ORDINALITY AS b(id, n)
    WHERE o.id = b.id AND o.seq IS NULL
    RETURNING o.seq
)
SELECT count(*), max(seq) FROM numbered
