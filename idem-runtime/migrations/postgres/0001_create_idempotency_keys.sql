-- idem: idempotency records (contract sections 4 and 7).
-- {table} and {index} are replaced by the configured, quoted names.
CREATE TABLE IF NOT EXISTS {table} (
    tenant           TEXT        NOT NULL,
    scope            TEXT        NOT NULL,
    key              TEXT        NOT NULL,
    fingerprint      TEXT        NOT NULL,
    state            TEXT        NOT NULL CHECK (state IN ('in_progress', 'completed')),
    operation_id     TEXT        NOT NULL,
    lock_token       TEXT,
    attempt          INTEGER     NOT NULL,
    lock_expires_at  TIMESTAMPTZ NOT NULL,
    recovery_point   TEXT,
    response_status  INTEGER,
    response_headers TEXT,
    response_body    BYTEA,
    created_at       TIMESTAMPTZ NOT NULL,
    expires_at       TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (tenant, scope, key)
);

-- The janitor deletes by expiry in bounded batches.
CREATE INDEX IF NOT EXISTS {index} ON {table} (expires_at);
