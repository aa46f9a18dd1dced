-- A session's rows keyed by the order sessions were created in, not by the session's id.
--
-- A session id is a hash (the contract makes it deterministic from its principal and
-- request_id), so the ledger's, the messages' and the event log's keys, which all led with it,
-- put each session's entries on leaves of their own, scattered among every other session's. A
-- commit of sixteen busy sessions dirtied sixteen leaves per index, and among 10,000 quiet
-- sessions those leaves were seldom the same twice. Keyed by the session's creation ordinal,
-- the sessions created together (the ones busy together, as a rule) share leaves at the right
-- edge of each index.
--
-- * `sessions.ordinal`: 1, 2, 3, … in creation order, set by the insert (one more than the
--   largest), unique, and never changed. (Not the rowid: `VACUUM` may renumber rowids.)
-- * `session_ordinal` beside the session id in the ledger, the messages and the event batches,
--   leading their session-keyed indexes in its place. The ids stay in the rows, for readers.
--
-- Every row's session exists (foreign keys are on in every connection); were one missing, its
-- ordinal would be NULL and the migration would stop there rather than drop the row.
--
-- The three tables are copied once, in this migration's transaction, keeping their rowids (the
-- ledger's `seq`, the messages' ids, and the batches' rowids, which order the event log's
-- pruning walk and are what `state_meta` remembers of it).
ALTER TABLE sessions ADD COLUMN ordinal INTEGER NOT NULL DEFAULT 0;
UPDATE sessions SET ordinal = rowid;
CREATE UNIQUE INDEX sessions_ordinal ON sessions(ordinal);

CREATE TABLE session_admissions_next (
    seq INTEGER PRIMARY KEY NOT NULL,
    admission_id TEXT NOT NULL UNIQUE,
    request_id TEXT NOT NULL,
    principal_id TEXT NOT NULL,
    target_session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE RESTRICT,
    session_ordinal INTEGER NOT NULL CHECK (session_ordinal > 0),
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
    UNIQUE (session_ordinal, principal_id, request_id)
);

INSERT INTO session_admissions_next (seq, admission_id, request_id, principal_id,
    target_session_id, session_ordinal, payload_json, payload_digest, intent, status, outcome,
    owner_epoch, execution_generation, result_json, created_at, updated_at)
SELECT a.seq, a.admission_id, a.request_id, a.principal_id, a.target_session_id,
    (SELECT s.ordinal FROM sessions s WHERE s.id = a.target_session_id),
    a.payload_json, a.payload_digest, a.intent, a.status, a.outcome, a.owner_epoch,
    a.execution_generation, a.result_json, a.created_at, a.updated_at
FROM session_admissions a
ORDER BY a.seq;

DROP TABLE session_admissions;
ALTER TABLE session_admissions_next RENAME TO session_admissions;
CREATE INDEX session_admissions_open ON session_admissions(session_ordinal, status, seq)
    WHERE status != 'terminal';

CREATE TABLE messages_next (
    id INTEGER PRIMARY KEY NOT NULL,
    session_id TEXT NOT NULL REFERENCES sessions(id),
    session_ordinal INTEGER NOT NULL CHECK (session_ordinal > 0),
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

INSERT INTO messages_next (id, session_id, session_ordinal, role, content, tool_call_id,
    tool_calls, tool_name, finish_reason, display_kind, admission_id, active, compacted, timestamp)
SELECT m.id, m.session_id, (SELECT s.ordinal FROM sessions s WHERE s.id = m.session_id),
    m.role, m.content, m.tool_call_id, m.tool_calls,
    m.tool_name, m.finish_reason, m.display_kind, m.admission_id, m.active, m.compacted,
    m.timestamp
FROM messages m
ORDER BY m.id;

DROP TABLE messages;
ALTER TABLE messages_next RENAME TO messages;
CREATE INDEX messages_live ON messages(session_ordinal, active, id);

CREATE TABLE session_event_batches_next (
    session_id TEXT NOT NULL REFERENCES sessions(id),
    session_ordinal INTEGER NOT NULL CHECK (session_ordinal > 0),
    last_seq BIGINT NOT NULL CHECK (last_seq > 0),
    first_seq BIGINT NOT NULL CHECK (first_seq > 0 AND first_seq <= last_seq),
    -- [[type, payload], ...] for first_seq..=last_seq
    events_json TEXT NOT NULL,
    created_at DOUBLE NOT NULL,
    PRIMARY KEY (session_ordinal, last_seq)
);

INSERT INTO session_event_batches_next (rowid, session_id, session_ordinal, last_seq, first_seq,
    events_json, created_at)
SELECT b.rowid, b.session_id, (SELECT s.ordinal FROM sessions s WHERE s.id = b.session_id),
    b.last_seq, b.first_seq, b.events_json, b.created_at
FROM session_event_batches b
ORDER BY b.rowid;

DROP TABLE session_event_batches;
ALTER TABLE session_event_batches_next RENAME TO session_event_batches;
