-- A session's last event sequence number is read from its log instead of kept in a head row.
--
-- Every commit that appended events advanced the session's head (an `UPDATE` and a `SELECT`
-- on the writer, and one more page in the commit's WAL write). The newest batch's key already
-- holds the same number, on the page the commit's insert writes anyway: a session's last
-- sequence number is its newest batch's `last_seq`, or, when pruning removed every batch, how
-- far the log was pruned (pruning removes only batches at or below that mark, so whenever a
-- batch is left the newest one is past it). The number therefore still never goes back.
--
-- What is left of the head is the pruning mark, kept only for the sessions pruning reached. The
-- count rule now reads the batches written since it last ran (how far it got is kept in
-- `state_meta`), where it read every head.
CREATE TABLE session_events_pruned (
    session_id TEXT PRIMARY KEY NOT NULL REFERENCES sessions(id),
    -- Every event up to and including this sequence number was pruned.
    through BIGINT NOT NULL CHECK (through > 0)
);

INSERT INTO session_events_pruned (session_id, through)
SELECT session_id, pruned_through FROM session_event_heads WHERE pruned_through > 0;

DROP TABLE session_event_heads;
