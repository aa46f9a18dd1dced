CREATE TABLE session_event_batches_prev (
    session_id TEXT NOT NULL REFERENCES sessions(id),
    last_seq BIGINT NOT NULL CHECK (last_seq > 0),
    first_seq BIGINT NOT NULL CHECK (first_seq > 0 AND first_seq <= last_seq),
    events_json TEXT NOT NULL,
    created_at DOUBLE NOT NULL,
    PRIMARY KEY (session_id, last_seq)
);
INSERT INTO session_event_batches_prev (rowid, session_id, last_seq, first_seq, events_json,
    created_at)
SELECT rowid, session_id, last_seq, first_seq, events_json, created_at
FROM session_event_batches ORDER BY rowid;
DROP TABLE session_event_batches;
ALTER TABLE session_event_batches_prev RENAME TO session_event_batches;

DROP INDEX messages_live;
ALTER TABLE messages DROP COLUMN session_ordinal;
CREATE INDEX messages_live ON messages(session_id, active, id);

CREATE TABLE session_admissions_prev (
    seq INTEGER PRIMARY KEY NOT NULL,
    admission_id TEXT NOT NULL UNIQUE,
    request_id TEXT NOT NULL,
    principal_id TEXT NOT NULL,
    target_session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE RESTRICT,
    payload_json TEXT NOT NULL,
    payload_digest TEXT NOT NULL,
    intent TEXT NOT NULL DEFAULT 'queue' CHECK (
        intent = 'queue'
        OR intent = 'steer'
        OR intent = 'redirect'
    ),
    status TEXT NOT NULL CHECK (
        status = 'queued'
        OR status = 'started'
        OR status = 'unknown'
        OR status = 'terminal'
    ),
    outcome TEXT CHECK (
        outcome IS NULL
        OR outcome = 'completed'
        OR outcome = 'interrupted'
        OR outcome = 'failed'
        OR outcome = 'cancelled'
        OR outcome = 'rejected'
    ),
    owner_epoch BIGINT,
    execution_generation BIGINT,
    result_json TEXT,
    created_at DOUBLE NOT NULL,
    updated_at DOUBLE NOT NULL,
    CHECK (status != 'started' OR (owner_epoch IS NOT NULL AND execution_generation IS NOT NULL)),
    UNIQUE (target_session_id, principal_id, request_id)
);
INSERT INTO session_admissions_prev (seq, admission_id, request_id, principal_id,
    target_session_id, payload_json, payload_digest, intent, status, outcome, owner_epoch,
    execution_generation, result_json, created_at, updated_at)
SELECT seq, admission_id, request_id, principal_id, target_session_id, payload_json,
    payload_digest, intent, status, outcome, owner_epoch, execution_generation, result_json,
    created_at, updated_at
FROM session_admissions ORDER BY seq;
DROP TABLE session_admissions;
ALTER TABLE session_admissions_prev RENAME TO session_admissions;
CREATE INDEX session_admissions_open ON session_admissions(target_session_id, status, seq)
    WHERE status != 'terminal';

DROP INDEX sessions_ordinal;
ALTER TABLE sessions DROP COLUMN ordinal;
