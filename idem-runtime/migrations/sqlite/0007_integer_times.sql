-- idem: the times are integers, milliseconds since the Unix epoch. SQLite
-- stores what it is given in a column of any declared type, and ranks any
-- text above every number: a time edited by hand as a date
-- (`datetime('now', '-1 hour')`) read as later than every clock, so a lock
-- never ran out and a record never expired, and one edited as a fraction
-- (`julianday` arithmetic) could not be read. From here on a time that is
-- not an integer is refused where it is written, with a message that says
-- what to write; times already edited so are read once, as SQLite reads
-- them: a fraction as its whole milliseconds, a date (UTC) as its instant,
-- and a purge time as not set yet (0: the janitor sets it from the
-- expiry). Text that is no date is left as it is.
-- {table}, {times_on_insert} and {times_on_update} are replaced by the
-- configured, quoted names.
UPDATE {table} SET lock_expires_at = CASE typeof(lock_expires_at)
        WHEN 'real' THEN CAST(lock_expires_at AS INTEGER)
        ELSE CAST(round((julianday(lock_expires_at) - 2440587.5) * 86400000) AS INTEGER) END
    WHERE typeof(lock_expires_at) = 'real'
        OR (typeof(lock_expires_at) = 'text' AND julianday(lock_expires_at) IS NOT NULL);
UPDATE {table} SET created_at = CASE typeof(created_at)
        WHEN 'real' THEN CAST(created_at AS INTEGER)
        ELSE CAST(round((julianday(created_at) - 2440587.5) * 86400000) AS INTEGER) END
    WHERE typeof(created_at) = 'real'
        OR (typeof(created_at) = 'text' AND julianday(created_at) IS NOT NULL);
UPDATE {table} SET expires_at = CASE typeof(expires_at)
        WHEN 'real' THEN CAST(expires_at AS INTEGER)
        ELSE CAST(round((julianday(expires_at) - 2440587.5) * 86400000) AS INTEGER) END
    WHERE typeof(expires_at) = 'real'
        OR (typeof(expires_at) = 'text' AND julianday(expires_at) IS NOT NULL);
UPDATE {table} SET purge_at = 0 WHERE typeof(purge_at) <> 'integer';
CREATE TRIGGER IF NOT EXISTS {times_on_insert} BEFORE INSERT ON {table} FOR EACH ROW
    WHEN typeof(NEW.lock_expires_at) <> 'integer' OR typeof(NEW.created_at) <> 'integer'
        OR typeof(NEW.expires_at) <> 'integer' OR typeof(NEW.purge_at) <> 'integer'
BEGIN
    SELECT RAISE(ABORT, 'idem: lock_expires_at, created_at, expires_at and purge_at are integers, milliseconds since the Unix epoch (for example CAST(unixepoch(''subsec'') * 1000 AS INTEGER))');
END;
CREATE TRIGGER IF NOT EXISTS {times_on_update} BEFORE UPDATE ON {table} FOR EACH ROW
    WHEN (typeof(NEW.lock_expires_at) <> 'integer' AND NEW.lock_expires_at IS NOT OLD.lock_expires_at)
        OR (typeof(NEW.created_at) <> 'integer' AND NEW.created_at IS NOT OLD.created_at)
        OR (typeof(NEW.expires_at) <> 'integer' AND NEW.expires_at IS NOT OLD.expires_at)
        OR (typeof(NEW.purge_at) <> 'integer' AND NEW.purge_at IS NOT OLD.purge_at)
BEGIN
    SELECT RAISE(ABORT, 'idem: lock_expires_at, created_at, expires_at and purge_at are integers, milliseconds since the Unix epoch (for example CAST(unixepoch(''subsec'') * 1000 AS INTEGER))');
END;
