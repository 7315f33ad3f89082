-- `seq` stays unique without it (an identity column); nothing reads by it any more: cleanup walks
-- {name:published_idx} and {name:dead_idx}, per-key order {name:key_idx}, the claim {name:pending_idx}.
DROP INDEX CONCURRENTLY IF EXISTS {qname:seq_idx}
