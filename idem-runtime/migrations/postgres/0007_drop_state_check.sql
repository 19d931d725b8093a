-- idem: the check on `state` goes. PostgreSQL rebuilds a table's check
-- constraints from their stored form (parsing it again) in every statement
-- that writes a row, so a first request paid for it twice: in its
-- reservation's insert and in its completion. Only idem's own statements
-- write `state`, always one of its two constants; a row edited by hand to
-- another value reads as a record in progress (a conflict, never replayed
-- and never run), until it expires by the records' rule.
-- {table} is replaced by the configured, quoted name.
DO $idem$
DECLARE
    found text;
BEGIN
    FOR found IN
        SELECT conname FROM pg_constraint
        WHERE conrelid = '{table}'::regclass AND contype = 'c'
          AND pg_get_constraintdef(oid) LIKE 'CHECK ((state = ANY (%'
    LOOP
        EXECUTE format('ALTER TABLE {table} DROP CONSTRAINT %I', found);
    END LOOP;
END
$idem$;
