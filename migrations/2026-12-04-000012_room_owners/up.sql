-- Who created each hosted room: only that principal (or the operator, on the control socket)
-- may read, drive or disband it. A room created before this table has no row and stays open to
-- every principal, as it was.
CREATE TABLE room_owners (
    room_id TEXT PRIMARY KEY NOT NULL REFERENCES rooms (room_id) ON DELETE CASCADE,
    principal TEXT NOT NULL
);
