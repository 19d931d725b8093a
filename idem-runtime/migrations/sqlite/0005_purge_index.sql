-- idem: the janitor finds records by `purge_at`, set when a key is reserved
-- and left alone when its answer is stored; the expiry index goes, so that
-- storing an answer updates no index. Records already there become
-- candidates at their expiry; one that an earlier build writes (the default,
-- 0) at once. Either way the janitor deletes only what is expired by the
-- records' own rule.
-- {table}, {purge_index} and {expiry_index} are replaced by the configured,
-- quoted names.
ALTER TABLE {table} ADD COLUMN purge_at INTEGER NOT NULL DEFAULT 0;
UPDATE {table} SET purge_at = expires_at;
CREATE INDEX IF NOT EXISTS {purge_index} ON {table} (purge_at);
DROP INDEX IF EXISTS {expiry_index};
