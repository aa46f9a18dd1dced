DROP TRIGGER room_task_tombstones_delete;
CREATE TRIGGER room_task_tombstones_delete AFTER DELETE ON room_tasks
BEGIN
    INSERT INTO room_task_tombstones (room_id, task_id, execution_generation)
    VALUES (OLD.room_id, OLD.task_id, OLD.execution_generation)
    ON CONFLICT (room_id, task_id) DO UPDATE
    SET execution_generation = max(execution_generation, excluded.execution_generation);
END;
