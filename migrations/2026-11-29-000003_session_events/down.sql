DROP TABLE IF EXISTS session_event_heads;
DROP INDEX IF EXISTS session_events_age;
DROP TABLE IF EXISTS session_events;
