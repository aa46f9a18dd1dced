-- CHECK constraints that name the allowed values one by one (`status = 'queued' OR ...`)
-- instead of in an `IN (...)` list. SQLite checks a constant list of three or more values by
-- building a temporary B-tree of it, each time a statement checks the constraint: an admission
-- built three (intent, status, outcome), a turn's claim and settlement three more and each
-- message one, all opened, filled and freed on the writer, the thread every commit waits for
-- (one in eight of its instructions over a turn, measured under callgrind). A chain of
-- comparisons accepts the same values and builds nothing. Two-value lists are compiled as
-- comparisons already and stay. The tables are copied once, in this migration's transaction.

CREATE TABLE session_admissions_next (
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

INSERT INTO session_admissions_next (seq, admission_id, request_id, principal_id,
    target_session_id, payload_json, payload_digest, intent, status, outcome, owner_epoch,
    execution_generation, result_json, created_at, updated_at)
SELECT seq, admission_id, request_id, principal_id, target_session_id, payload_json,
    payload_digest, intent, status, outcome, owner_epoch, execution_generation, result_json,
    created_at, updated_at
FROM session_admissions
ORDER BY seq;

DROP TABLE session_admissions;
ALTER TABLE session_admissions_next RENAME TO session_admissions;
CREATE INDEX session_admissions_open ON session_admissions(target_session_id, status, seq)
    WHERE status != 'terminal';

CREATE TABLE messages_next (
    id INTEGER PRIMARY KEY NOT NULL,
    session_id TEXT NOT NULL REFERENCES sessions(id),
    role TEXT NOT NULL CHECK (
        role = 'user'
        OR role = 'assistant'
        OR role = 'tool'
        OR role = 'system'
    ),
    content TEXT,
    tool_call_id TEXT,
    tool_calls TEXT,
    tool_name TEXT,
    finish_reason TEXT,
    display_kind TEXT,
    admission_id TEXT,
    active INTEGER NOT NULL DEFAULT 1,
    compacted INTEGER NOT NULL DEFAULT 0,
    timestamp DOUBLE NOT NULL
);

INSERT INTO messages_next (id, session_id, role, content, tool_call_id, tool_calls, tool_name,
    finish_reason, display_kind, admission_id, active, compacted, timestamp)
SELECT id, session_id, role, content, tool_call_id, tool_calls, tool_name, finish_reason,
    display_kind, admission_id, active, compacted, timestamp
FROM messages
ORDER BY id;

DROP TABLE messages;
ALTER TABLE messages_next RENAME TO messages;
CREATE INDEX messages_live ON messages(session_id, active, id);

CREATE TABLE room_tasks_next (
    room_id TEXT NOT NULL REFERENCES rooms(room_id) ON DELETE CASCADE,
    task_id TEXT NOT NULL,
    thread_id TEXT NOT NULL,
    turn_id TEXT NOT NULL,
    source_event_seq INTEGER NOT NULL CHECK (source_event_seq >= 1),
    payload_json TEXT NOT NULL,
    payload_digest TEXT NOT NULL,
    status TEXT NOT NULL CHECK (
        status = 'queued'
        OR status = 'running'
        OR status = 'stopping'
        OR status = 'settled'
        OR status = 'failed'
        OR status = 'cancelled'
        OR status = 'indeterminate'
        OR status = 'deferred'
    ),
    execution_generation INTEGER NOT NULL DEFAULT 0 CHECK (execution_generation >= 0),
    cancel_generation INTEGER NOT NULL DEFAULT 0 CHECK (cancel_generation >= 0),
    run_gateway_id TEXT,
    run_process_generation TEXT,
    run_lease_generation INTEGER,
    cancel_id TEXT,
    settlement_id TEXT,
    settlement_status TEXT CHECK (
        settlement_status IS NULL
        OR settlement_status IN ('settled', 'failed')
    ),
    result_json TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    started_at REAL,
    terminal_at REAL,
    indeterminate_at REAL,
    PRIMARY KEY (room_id, task_id),
    UNIQUE (room_id, thread_id, turn_id)
);

INSERT INTO room_tasks_next (room_id, task_id, thread_id, turn_id, source_event_seq, payload_json,
    payload_digest, status, execution_generation, cancel_generation, run_gateway_id,
    run_process_generation, run_lease_generation, cancel_id, settlement_id, settlement_status,
    result_json, created_at, updated_at, started_at, terminal_at, indeterminate_at)
SELECT room_id, task_id, thread_id, turn_id, source_event_seq, payload_json, payload_digest,
    status, execution_generation, cancel_generation, run_gateway_id, run_process_generation,
    run_lease_generation, cancel_id, settlement_id, settlement_status, result_json, created_at,
    updated_at, started_at, terminal_at, indeterminate_at
FROM room_tasks;

-- Dropping the table drops its triggers; the counts they keep are already right.
DROP TABLE room_tasks;
ALTER TABLE room_tasks_next RENAME TO room_tasks;
CREATE INDEX room_tasks_room_order
    ON room_tasks (room_id, status, source_event_seq, created_at, task_id);

CREATE TRIGGER room_task_counts_insert AFTER INSERT ON room_tasks
BEGIN
    INSERT INTO room_task_counts (room_id, status, n) VALUES (NEW.room_id, NEW.status, 1)
    ON CONFLICT (room_id, status) DO UPDATE SET n = n + 1;
END;

CREATE TRIGGER room_task_counts_update AFTER UPDATE OF status ON room_tasks
WHEN OLD.status IS NOT NEW.status
BEGIN
    UPDATE room_task_counts SET n = n - 1 WHERE room_id = OLD.room_id AND status = OLD.status;
    INSERT INTO room_task_counts (room_id, status, n) VALUES (NEW.room_id, NEW.status, 1)
    ON CONFLICT (room_id, status) DO UPDATE SET n = n + 1;
END;

CREATE TRIGGER room_task_counts_delete AFTER DELETE ON room_tasks
BEGIN
    UPDATE room_task_counts SET n = n - 1 WHERE room_id = OLD.room_id AND status = OLD.status;
END;
