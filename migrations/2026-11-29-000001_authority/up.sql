-- Session authority: epochs, sessions (with compression lineage), the admission ledger,
-- transcripts, prompt audit and the durable approval allow-lists.
CREATE TABLE runtime_epoch (
    singleton INTEGER PRIMARY KEY NOT NULL CHECK (singleton = 1),
    epoch BIGINT NOT NULL CHECK (epoch > 0),
    instance_id TEXT NOT NULL,
    started_at DOUBLE NOT NULL
);

CREATE TABLE state_meta (
    key TEXT PRIMARY KEY NOT NULL,
    value TEXT NOT NULL
);

CREATE TABLE sessions (
    id TEXT PRIMARY KEY NOT NULL,
    root_id TEXT NOT NULL,
    parent_session_id TEXT REFERENCES sessions(id),
    tip_session_id TEXT NOT NULL,
    principal_id TEXT NOT NULL,
    request_id TEXT NOT NULL,
    request_digest TEXT NOT NULL,
    source TEXT NOT NULL,
    model TEXT NOT NULL,
    provider TEXT NOT NULL,
    base_url TEXT,
    cwd TEXT NOT NULL,
    toolsets_json TEXT NOT NULL,
    profile TEXT NOT NULL,
    title TEXT,
    system_prompt TEXT,
    runtime_generation BIGINT NOT NULL DEFAULT 0,
    runtime_revision BIGINT NOT NULL DEFAULT 0,
    compression_count INTEGER NOT NULL DEFAULT 0,
    prompt_tokens BIGINT NOT NULL DEFAULT 0,
    completion_tokens BIGINT NOT NULL DEFAULT 0,
    started_at DOUBLE NOT NULL,
    ended_at DOUBLE,
    end_reason TEXT
);
CREATE INDEX sessions_parent ON sessions(parent_session_id);
CREATE INDEX sessions_root ON sessions(root_id);

CREATE TABLE session_admissions (
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
CREATE INDEX session_admissions_fifo ON session_admissions(target_session_id, status, seq);
CREATE INDEX session_admissions_status ON session_admissions(status);

CREATE TABLE messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT NOT NULL,
    session_id TEXT NOT NULL REFERENCES sessions(id),
    role TEXT NOT NULL CHECK (role IN ('user', 'assistant', 'tool', 'system')),
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
CREATE INDEX messages_live ON messages(session_id, active, id);

CREATE TABLE prompts (
    prompt_id TEXT PRIMARY KEY NOT NULL,
    session_id TEXT NOT NULL REFERENCES sessions(id),
    admission_id TEXT NOT NULL,
    execution_generation BIGINT NOT NULL,
    kind TEXT NOT NULL CHECK (kind IN ('approval', 'clarify')),
    payload_json TEXT NOT NULL,
    opened_at DOUBLE NOT NULL,
    resolved_at DOUBLE,
    resolution TEXT,
    resolved_by TEXT
);
CREATE INDEX prompts_session ON prompts(session_id, resolved_at);

CREATE TABLE approval_allowlist (
    pattern_key TEXT PRIMARY KEY NOT NULL,
    created_at DOUBLE NOT NULL,
    created_by TEXT NOT NULL
);

CREATE TABLE session_approvals (
    session_id TEXT NOT NULL REFERENCES sessions(id),
    pattern_key TEXT NOT NULL,
    created_at DOUBLE NOT NULL,
    PRIMARY KEY (session_id, pattern_key)
);
