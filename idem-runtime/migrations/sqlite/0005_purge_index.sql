-- idem: the janitor finds records by `purge_at`, set when a key is reserved
-- and left alone when its answer is stored; the expiry index goes, so that
-- storing an answer updates no index. The column is added with a constant
-- default, which rewrites no row. Rows already there, and rows an earlier
-- build writes, hold the default, 0 ("not set yet"): the janitor sets them
-- from their expiry in small batches. Either way it deletes only what is
-- expired by the records' own rule.
-- {table}, {purge_index} and {expiry_index} are replaced by the configured,
-- quoted names.
ALTER TABLE {table} ADD COLUMN purge_at INTEGER NOT NULL DEFAULT 0;
CREATE INDEX IF NOT EXISTS {purge_index} ON {table} (purge_at);
DROP INDEX IF EXISTS {expiry_index};
