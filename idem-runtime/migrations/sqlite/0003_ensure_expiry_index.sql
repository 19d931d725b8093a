-- idem: the janitor's expiry index, for tables whose first build skipped it
-- (a long table name truncated the index's name onto the table's own).
CREATE INDEX IF NOT EXISTS {index} ON {table} (expires_at);
