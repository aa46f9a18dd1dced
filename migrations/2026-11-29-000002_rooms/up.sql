-- Hosted rooms: rooms, members, events, driver leases and room tasks.

CREATE TABLE rooms (
    room_id TEXT PRIMARY KEY NOT NULL,
    name TEXT NOT NULL,
    authority_gateway_id TEXT NOT NULL,
    authority_epoch INTEGER NOT NULL DEFAULT 1 CHECK (authority_epoch >= 1),
    next_seq INTEGER NOT NULL DEFAULT 1 CHECK (next_seq >= 1),
    revision INTEGER NOT NULL DEFAULT 1 CHECK (revision >= 1),
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    disband_requested_at REAL,
    disbanded_at REAL
);

CREATE TABLE room_members (
    room_id TEXT NOT NULL REFERENCES rooms(room_id) ON DELETE CASCADE,
    position INTEGER NOT NULL CHECK (position >= 0),
    handle TEXT NOT NULL,
    profile TEXT NOT NULL,
    PRIMARY KEY (room_id, position),
    UNIQUE (room_id, handle)
);

CREATE TABLE room_events (
    room_id TEXT NOT NULL REFERENCES rooms(room_id) ON DELETE CASCADE,
    seq INTEGER NOT NULL CHECK (seq >= 1),
    event_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    actor_json TEXT NOT NULL,
    authority_epoch INTEGER,
    payload_json TEXT NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (room_id, seq),
    UNIQUE (room_id, event_id)
);

CREATE TABLE room_leases (
    room_id TEXT PRIMARY KEY NOT NULL REFERENCES rooms(room_id) ON DELETE CASCADE,
    gateway_id TEXT NOT NULL,
    authority_epoch INTEGER NOT NULL CHECK (authority_epoch >= 1),
    process_generation TEXT NOT NULL,
    lease_generation INTEGER NOT NULL CHECK (lease_generation >= 1),
    expires_at REAL NOT NULL,
    acquired_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    released_at REAL
);

CREATE TABLE room_tasks (
    room_id TEXT NOT NULL REFERENCES rooms(room_id) ON DELETE CASCADE,
    task_id TEXT NOT NULL,
    thread_id TEXT NOT NULL,
    turn_id TEXT NOT NULL,
    source_event_seq INTEGER NOT NULL CHECK (source_event_seq >= 1),
    payload_json TEXT NOT NULL,
    payload_digest TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN (
        'queued', 'running', 'stopping', 'settled', 'failed', 'cancelled', 'indeterminate', 'deferred'
    )),
    execution_generation INTEGER NOT NULL DEFAULT 0 CHECK (execution_generation >= 0),
    cancel_generation INTEGER NOT NULL DEFAULT 0 CHECK (cancel_generation >= 0),
    run_gateway_id TEXT,
    run_process_generation TEXT,
    run_lease_generation INTEGER,
    cancel_id TEXT,
    settlement_id TEXT,
    settlement_status TEXT CHECK (settlement_status IS NULL OR settlement_status IN ('settled', 'failed')),
    result_json TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    started_at REAL,
    terminal_at REAL,
    indeterminate_at REAL,
    PRIMARY KEY (room_id, task_id),
    UNIQUE (room_id, thread_id, turn_id)
);

CREATE INDEX room_tasks_room_order
    ON room_tasks (room_id, status, source_event_seq, created_at, task_id);
