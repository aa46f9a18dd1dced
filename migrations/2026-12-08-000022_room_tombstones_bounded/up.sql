-- A pruned room task leaves a tombstone only when a member may know its attempts: it made one
-- (execution_generation > 0) and its room is not retired (a retired room's id admits nothing
-- again). A task cancelled while queued left one too, and a client that admitted and cancelled
-- tasks in a loop grew the table without bound.
DROP TRIGGER room_task_tombstones_delete;
CREATE TRIGGER room_task_tombstones_delete AFTER DELETE ON room_tasks
WHEN OLD.execution_generation > 0
    AND NOT EXISTS (
        SELECT 1 FROM rooms WHERE rooms.room_id = OLD.room_id AND rooms.disbanded_at IS NOT NULL
    )
BEGIN
    INSERT INTO room_task_tombstones (room_id, task_id, execution_generation)
    VALUES (OLD.room_id, OLD.task_id, OLD.execution_generation)
    ON CONFLICT (room_id, task_id) DO UPDATE
    SET execution_generation = max(execution_generation, excluded.execution_generation);
END;
DELETE FROM room_task_tombstones
WHERE execution_generation = 0
    OR room_id IN (SELECT room_id FROM rooms WHERE disbanded_at IS NOT NULL);
