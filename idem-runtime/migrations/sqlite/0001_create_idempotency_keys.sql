-- idem: idempotency records (contract sections 4 and 7).
-- Times are milliseconds since the Unix epoch, from SQLite's own clock.
-- {table} and {index} are replaced by the configured, quoted names.
CREATE TABLE IF NOT EXISTS {table} (
    tenant           TEXT    NOT NULL,
    scope            TEXT    NOT NULL,
    key              TEXT    NOT NULL,
    fingerprint      TEXT    NOT NULL,
    state            TEXT    NOT NULL CHECK (state IN ('in_progress', 'completed')),
    operation_id     TEXT    NOT NULL,
    lock_token       TEXT,
    attempt          INTEGER NOT NULL,
    lock_expires_at  INTEGER NOT NULL,
    recovery_point   TEXT,
    response_status  INTEGER,
    response_headers TEXT,
    response_body    BLOB,
    created_at       INTEGER NOT NULL,
    expires_at       INTEGER NOT NULL,
    PRIMARY KEY (tenant, scope, key)
) WITHOUT ROWID;

CREATE INDEX IF NOT EXISTS {index} ON {table} (expires_at);
