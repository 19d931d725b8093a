-- idem: whether the execution holding the lock took over a stale one.
ALTER TABLE {table} ADD COLUMN taken_over INTEGER NOT NULL DEFAULT 0;
