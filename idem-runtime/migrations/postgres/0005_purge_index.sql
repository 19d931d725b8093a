-- idem: the janitor finds records by `purge_at`, set when a key is reserved
-- and left alone when its answer is stored; the expiry index goes. Storing
-- an answer then changes no indexed column, and PostgreSQL updates the row
-- in place (a HOT update: no new index entries, less WAL).
-- The column is added with a constant default, which rewrites no row (the
-- table is locked only for a moment, and while the index builds, writes
-- wait). Rows already there, and rows an earlier build writes during a
-- rolling upgrade, hold the default, '-infinity' ("not set yet"): the
-- janitor sets them from their expiry in small batches. Either way it
-- deletes only what is expired by the records' own rule.
-- {table}, {purge_index} and {expiry_index} are replaced by the configured,
-- quoted names.
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS purge_at TIMESTAMPTZ NOT NULL DEFAULT '-infinity';
CREATE INDEX IF NOT EXISTS {purge_index} ON {table} (purge_at);
DROP INDEX IF EXISTS {expiry_index};
