-- Room task counts by status, kept by triggers on room_tasks, so that /metrics and room.get
-- read a handful of rows instead of counting every task of a room (or of all rooms) each time.
-- Rooms keep their tasks for good (every task id stays idempotent), so a count over room_tasks
-- grows with the whole history.
CREATE TABLE room_task_counts (
    room_id TEXT NOT NULL REFERENCES rooms(room_id) ON DELETE CASCADE,
    status TEXT NOT NULL,
    n INTEGER NOT NULL CHECK (n >= 0),
    PRIMARY KEY (room_id, status)
) WITHOUT ROWID;

INSERT INTO room_task_counts (room_id, status, n)
SELECT room_id, status, count(*) FROM room_tasks GROUP BY room_id, status;

CREATE TRIGGER room_task_counts_insert AFTER INSERT ON room_tasks
BEGIN
    INSERT INTO room_task_counts (room_id, status, n) VALUES (NEW.room_id, NEW.status, 1)
    ON CONFLICT (room_id, status) DO UPDATE SET n = n + 1;
END;

CREATE TRIGGER room_task_counts_update AFTER UPDATE OF status ON room_tasks
WHEN OLD.status IS NOT NEW.status
BEGIN
    UPDATE room_task_counts SET n = n - 1 WHERE room_id = OLD.room_id AND status = OLD.status;
    INSERT INTO room_task_counts (room_id, status, n) VALUES (NEW.room_id, NEW.status, 1)
    ON CONFLICT (room_id, status) DO UPDATE SET n = n + 1;
END;

-- Also for the deletes of a room's cascade.
CREATE TRIGGER room_task_counts_delete AFTER DELETE ON room_tasks
BEGIN
    UPDATE room_task_counts SET n = n - 1 WHERE room_id = OLD.room_id AND status = OLD.status;
END;
