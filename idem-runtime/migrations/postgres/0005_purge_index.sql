-- idem: the janitor finds records by `purge_at`, set when a key is reserved
-- and left alone when its answer is stored; the expiry index goes. Storing
-- an answer then changes no indexed column, and PostgreSQL updates the row
-- in place (a HOT update: no new index entries, less WAL).
-- Records already there become candidates at their expiry. A record that an
-- earlier build writes during a rolling upgrade gets the time it was written
-- (the default), and is a candidate from then on. Either way the janitor
-- deletes only what is expired by the records' own rule.
-- {table}, {purge_index} and {expiry_index} are replaced by the configured,
-- quoted names.
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS purge_at TIMESTAMPTZ NOT NULL DEFAULT now();
UPDATE {table} SET purge_at = expires_at;
CREATE INDEX IF NOT EXISTS {purge_index} ON {table} (purge_at);
DROP INDEX IF EXISTS {expiry_index};
