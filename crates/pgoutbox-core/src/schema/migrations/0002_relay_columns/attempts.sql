-- Only for a minimal table whose `attempts` is nullable: one batch of `attempts = 0` where it is
-- NULL, over the next $1 rows in seq order from the cursor $2 (a range of {name:seq_idx}).
-- Returns (rows fixed, the chunk's last seq), the seq NULL past the end of the table.
WITH chunk AS (
    SELECT seq FROM {outbox} WHERE seq > $2 ORDER BY seq LIMIT $1
),
fixed AS (
    UPDATE {outbox} SET attempts = 0
    WHERE seq > $2 AND seq <= (SELECT max(seq) FROM chunk) AND attempts IS NULL
    RETURNING 1
)
SELECT (SELECT count(*) FROM fixed), (SELECT max(seq) FROM chunk)
