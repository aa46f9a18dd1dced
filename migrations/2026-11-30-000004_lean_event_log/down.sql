DROP INDEX IF EXISTS session_admissions_live;
CREATE INDEX session_admissions_status ON session_admissions(status);

CREATE TABLE session_events (
    session_id TEXT NOT NULL REFERENCES sessions(id),
    seq BIGINT NOT NULL CHECK (seq > 0),
    type TEXT NOT NULL,
    payload_json TEXT NOT NULL,
    created_at DOUBLE NOT NULL,
    PRIMARY KEY (session_id, seq)
);
CREATE INDEX session_events_age ON session_events(created_at);

INSERT INTO session_events (session_id, seq, type, payload_json, created_at)
SELECT b.session_id, b.first_seq + CAST(e.key AS INTEGER), json_extract(e.value, '$[0]'),
       json(json_extract(e.value, '$[1]')), b.created_at
FROM session_event_batches AS b, json_each(b.events_json) AS e
ORDER BY b.rowid, e.key;

DROP TABLE session_event_batches;
