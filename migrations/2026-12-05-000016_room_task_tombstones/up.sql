-- A pruned room task leaves its id and the last execution generation it used. A task admitted
-- again under that id is a new task, and its attempts go on from that generation: an attempt is
-- known to its member as `room/<room>/<task>/<generation>` (the member's ledger keeps it for
-- good), and a new task's first attempt under a reused (room, task, 1) would be answered with
-- the old task's reply instead of running.
CREATE TABLE room_task_tombstones (
    room_id TEXT NOT NULL,
    task_id TEXT NOT NULL,
    execution_generation INTEGER NOT NULL CHECK (execution_generation >= 0),
    PRIMARY KEY (room_id, task_id)
) WITHOUT ROWID;

CREATE TRIGGER room_task_tombstones_delete AFTER DELETE ON room_tasks
BEGIN
    INSERT INTO room_task_tombstones (room_id, task_id, execution_generation)
    VALUES (OLD.room_id, OLD.task_id, OLD.execution_generation)
    ON CONFLICT (room_id, task_id) DO UPDATE
    SET execution_generation = max(execution_generation, excluded.execution_generation);
END;
