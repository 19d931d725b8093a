-- idem: nothing on PostgreSQL, whose time columns are typed (timestamptz):
-- a time edited by hand is a time, or is refused. The version keeps both
-- stores' schema versions the same (SQLite's times are checked here).
SELECT 1;
