CREATE TABLE messages_full (
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

INSERT INTO messages_full (id, session_id, role, content, tool_call_id, tool_calls, tool_name,
    finish_reason, display_kind, admission_id, active, compacted, timestamp)
SELECT id, session_id, role, content, tool_call_id, tool_calls, tool_name, finish_reason,
    display_kind, admission_id, active, compacted, timestamp
FROM messages
ORDER BY id;

DROP TABLE messages;
ALTER TABLE messages_full RENAME TO messages;
CREATE INDEX messages_live ON messages(session_id, active, id);
