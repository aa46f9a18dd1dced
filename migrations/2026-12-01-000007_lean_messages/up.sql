-- Messages without AUTOINCREMENT: every claim and every settlement inserts messages, and each
-- such commit also rewrote `sqlite_sequence` (one more B-tree update and WAL frame). A message's
-- id is the rowid, one more than the largest. Ids order a session's messages and are not shown
-- outside; the only message ever deleted is the user message of a claim put back at a graceful
-- stop, the newest row, so an id it frees is taken by the next message, which still sorts after
-- every message kept. The table is copied once, in this migration's transaction.
CREATE TABLE messages_lean (
    id INTEGER PRIMARY KEY NOT NULL,
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

INSERT INTO messages_lean (id, session_id, role, content, tool_call_id, tool_calls, tool_name,
    finish_reason, display_kind, admission_id, active, compacted, timestamp)
SELECT id, session_id, role, content, tool_call_id, tool_calls, tool_name, finish_reason,
    display_kind, admission_id, active, compacted, timestamp
FROM messages
ORDER BY id;

DROP TABLE messages;
ALTER TABLE messages_lean RENAME TO messages;
CREATE INDEX messages_live ON messages(session_id, active, id);
DELETE FROM sqlite_sequence WHERE name = 'messages';
