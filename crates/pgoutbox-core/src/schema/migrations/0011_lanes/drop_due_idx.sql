-- Replaced by {name:deliveries_lane_idx}: every statement that read the due pairs now reads them
-- per destination.
DROP INDEX CONCURRENTLY IF EXISTS {qname:deliveries_due_idx}
