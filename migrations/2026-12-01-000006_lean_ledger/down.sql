CREATE TABLE session_admissions_full (
    seq INTEGER PRIMARY KEY AUTOINCREMENT NOT NULL,
    admission_id TEXT NOT NULL UNIQUE,
    request_id TEXT NOT NULL,
    principal_id TEXT NOT NULL,
    target_session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE RESTRICT,
    payload_json TEXT NOT NULL,
    payload_digest TEXT NOT NULL,
    intent TEXT NOT NULL DEFAULT 'queue' CHECK (intent IN ('queue', 'steer', 'redirect')),
    status TEXT NOT NULL CHECK (status IN ('queued', 'started', 'unknown', 'terminal')),
    outcome TEXT CHECK (outcome IS NULL OR outcome IN ('completed', 'interrupted', 'failed', 'cancelled', 'rejected')),
    owner_epoch BIGINT,
    execution_generation BIGINT,
    result_json TEXT,
    created_at DOUBLE NOT NULL,
    updated_at DOUBLE NOT NULL,
    CHECK (status != 'started' OR (owner_epoch IS NOT NULL AND execution_generation IS NOT NULL)),
    UNIQUE (principal_id, target_session_id, request_id)
);

INSERT INTO session_admissions_full (seq, admission_id, request_id, principal_id, target_session_id,
    payload_json, payload_digest, intent, status, outcome, owner_epoch, execution_generation,
    result_json, created_at, updated_at)
SELECT seq, admission_id, request_id, principal_id, target_session_id, payload_json,
    payload_digest, intent, status, outcome, owner_epoch, execution_generation, result_json,
    created_at, updated_at
FROM session_admissions
ORDER BY seq;

DROP TABLE session_admissions;
ALTER TABLE session_admissions_full RENAME TO session_admissions;
CREATE INDEX session_admissions_fifo ON session_admissions(target_session_id, status, seq);
CREATE INDEX session_admissions_live ON session_admissions(status) WHERE status != 'terminal';
