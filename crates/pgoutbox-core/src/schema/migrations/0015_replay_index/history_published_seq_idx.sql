-- The history's side of ReplayRead, and EventSearch's (published newest first): each partition's
-- range in (published_at, seq) order. Created on the parent alone (INVALID until each partition's
-- index, built concurrently, is attached: the runner does that); partitions created later get
-- theirs from it. Replaces {name:history_published_idx}.
CREATE INDEX IF NOT EXISTS {name:history_published_seq_idx} ON ONLY {qname:history} (published_at, seq)
