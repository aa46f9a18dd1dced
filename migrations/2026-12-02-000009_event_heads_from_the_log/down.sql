CREATE TABLE session_event_heads (
    session_id TEXT PRIMARY KEY NOT NULL REFERENCES sessions(id),
    last_seq BIGINT NOT NULL DEFAULT 0,
    pruned_through BIGINT NOT NULL DEFAULT 0,
    CHECK (pruned_through >= 0 AND pruned_through <= last_seq)
);

INSERT INTO session_event_heads (session_id, last_seq, pruned_through)
SELECT id,
       max(coalesce((SELECT max(b.last_seq) FROM session_event_batches b WHERE b.session_id = id), 0),
           coalesce((SELECT p.through FROM session_events_pruned p WHERE p.session_id = id), 0)),
       coalesce((SELECT p.through FROM session_events_pruned p WHERE p.session_id = id), 0)
FROM (SELECT session_id AS id FROM session_events_pruned
      UNION SELECT session_id FROM session_event_batches);

DROP TABLE session_events_pruned;

-- How far the count rule had walked the log (kept by the code this migration came with).
DELETE FROM state_meta WHERE key = 'session_events.count_rule_seen';
