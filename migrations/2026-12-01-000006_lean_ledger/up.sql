-- A leaner admission. Read from the WAL of a bench run, an admission's commit wrote 9 pages, and
-- the turn's claim and settlement 11 and 10; each page is a B-tree updated on the writer, the
-- thread every commit waits for. Four of them go:
--
-- * No AUTOINCREMENT: `seq` is the rowid, one more than the largest. Admissions are never
--   deleted, so it still only grows (FIFO order and idempotency rest on that), and no commit
--   rewrites `sqlite_sequence` any more.
-- * One index for the live rows, `session_admissions_open (target_session_id, status, seq)`
--   where `status != 'terminal'`, instead of the FIFO index over the whole ledger and the
--   status index of live rows: a claim and a settlement moved a row's entry in both. Settled
--   rows, almost all of the ledger, are in no status index; queries across sessions (boot
--   recovery, the pumps to start, operator lists) walk the live rows, which are few.
-- * The idempotency key leads with the session: `(target_session_id, principal_id, request_id)`.
--   It serves the lookup of a replayed input as before, and a session's settled rows (a room
--   member's history) are found through it, now that no other index holds them.
--
-- The ledger is copied once, in this migration's transaction.
CREATE TABLE session_admissions_lean (
    seq INTEGER PRIMARY KEY NOT NULL,
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
    UNIQUE (target_session_id, principal_id, request_id)
);

INSERT INTO session_admissions_lean (seq, admission_id, request_id, principal_id, target_session_id,
    payload_json, payload_digest, intent, status, outcome, owner_epoch, execution_generation,
    result_json, created_at, updated_at)
SELECT seq, admission_id, request_id, principal_id, target_session_id, payload_json,
    payload_digest, intent, status, outcome, owner_epoch, execution_generation, result_json,
    created_at, updated_at
FROM session_admissions
ORDER BY seq;

DROP TABLE session_admissions;
ALTER TABLE session_admissions_lean RENAME TO session_admissions;
CREATE INDEX session_admissions_open ON session_admissions(target_session_id, status, seq)
    WHERE status != 'terminal';
DELETE FROM sqlite_sequence WHERE name = 'session_admissions';
