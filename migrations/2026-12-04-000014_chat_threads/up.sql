-- Which session goes on with a chat-completions conversation: a request's whole list of messages
-- (hashed, with its end user and profile) names the session its input was admitted to, so the
-- next request of that conversation (that list, the answer, a new user message) finds it.
CREATE TABLE chat_threads (
    principal_id TEXT NOT NULL,
    thread_key TEXT NOT NULL,
    session_id TEXT NOT NULL,
    created_at DOUBLE NOT NULL,
    PRIMARY KEY (principal_id, thread_key)
) WITHOUT ROWID;
-- Records older than the event log's retention are pruned, oldest first: a conversation that
-- comes back after that starts a new session holding its history.
CREATE INDEX chat_threads_age ON chat_threads(created_at);
