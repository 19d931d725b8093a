-- idem: the check on `state` that the first schema made goes. Not a
-- schema version: no build needs it gone, so `migrate()` runs this after the
-- migrations every time (`PgStore::state_check_drop_sql()` gives it to your
-- own tool), and a build before it still finds the table at its own
-- version during a rolling upgrade. PostgreSQL
-- rebuilds a table's check constraints from their stored form in every
-- statement that writes a row, so a first request paid for it twice: in its
-- reservation's insert and in its completion. Only idem's own statements
-- write `state`, always one of its two constants; a row edited by hand to
-- another value reads as a record in progress (a conflict, never replayed
-- and never run), until it expires by the records' rule.
--
-- Only that check goes: one that reads exactly as the first schema wrote it
-- (whatever the session's quoting of identifiers). Checks of your own stay,
-- even on `state`, unless one reads exactly so: write such a guard in
-- another form (`state IN ('completed', 'in_progress')`) to keep it.
-- `migrate()` looks for the check with a plain query first, and runs this
-- only when it is there. Run it after the migrations, and in a transaction
-- of its own: the table's lock, once taken, is held until the commit.
-- Dropping it needs the
-- table's lock, which waits for every transaction that has read the table,
-- and every request to the table would queue behind that wait: it waits at
-- most half a second (less when the session's own `lock_timeout` is
-- shorter, and at most half its `statement_timeout`, which would otherwise
-- cancel the whole statement), and when a transaction holds the lock longer
-- (or the role may not alter the table) the check stays, until the next
-- `migrate()`. Nothing else depends on it.
-- {table} is replaced by the configured, quoted name.
DO $idem$
DECLARE
    found text;
    lock_wait text := current_setting('lock_timeout');
    bound interval := interval '500 ms';
BEGIN
    IF lock_wait <> '0' THEN
        bound := least(bound, lock_wait::interval);
    END IF;
    IF current_setting('statement_timeout') <> '0' THEN
        bound := least(bound, current_setting('statement_timeout')::interval / 2);
    END IF;
    PERFORM set_config('lock_timeout',
        greatest(1, round(extract(epoch FROM bound) * 1000))::bigint || 'ms', true);
    FOR found IN
        SELECT conname FROM pg_constraint
        WHERE conrelid = '{table}'::regclass AND contype = 'c'
          AND replace(pg_get_constraintdef(oid), '"', '')
            = 'CHECK ((state = ANY (ARRAY[''in_progress''::text, ''completed''::text])))'
    LOOP
        BEGIN
            EXECUTE format('ALTER TABLE {table} DROP CONSTRAINT %I', found);
        EXCEPTION WHEN lock_not_available OR insufficient_privilege THEN
            RAISE NOTICE 'idem: the check % on {table} stays for now (%); the next migrate() tries again',
                found, SQLERRM;
            EXIT;
        END;
    END LOOP;
    PERFORM set_config('lock_timeout', lock_wait, true);
END
$idem$;
