-- The durable per-session event log: every notification that reports a committed state change is
-- written in the same transaction as that change, so a client that reconnects can read what it
-- missed. `session_event_heads` keeps each session's last sequence number (which never goes back,
-- even when old events are pruned) and how far the log was pruned (to answer `truncated`).
CREATE TABLE session_events (
    session_id TEXT NOT NULL REFERENCES sessions(id),
    seq BIGINT NOT NULL CHECK (seq > 0),
    type TEXT NOT NULL,
    payload_json TEXT NOT NULL,
    created_at DOUBLE NOT NULL,
    PRIMARY KEY (session_id, seq)
);
CREATE INDEX session_events_age ON session_events(created_at);

CREATE TABLE session_event_heads (
    session_id TEXT PRIMARY KEY NOT NULL REFERENCES sessions(id),
    last_seq BIGINT NOT NULL DEFAULT 0,
    pruned_through BIGINT NOT NULL DEFAULT 0,
    CHECK (pruned_through >= 0 AND pruned_through <= last_seq)
);
