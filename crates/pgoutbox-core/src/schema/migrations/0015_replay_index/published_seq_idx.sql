-- A replay walks the published rows in (published_at, seq) order from its cursor (ReplayRead);
-- cleanup walks them oldest first by published_at, the index's leading column. With published_at
-- alone, every replay step read and sorted all the rows published at the cursor's instant, and a
-- settle publishes thousands of rows at one instant. Replaces {name:published_idx}.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {name:published_seq_idx} ON {outbox} (published_at, seq)
    WHERE published_at IS NOT NULL
