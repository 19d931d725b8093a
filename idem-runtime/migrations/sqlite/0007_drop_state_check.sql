-- idem: nothing on SQLite, which compiles the check on `state` into each
-- prepared statement once, where PostgreSQL rebuilt it in every write. The
-- version keeps both stores' schema versions the same.
SELECT 1;
