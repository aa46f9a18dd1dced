DROP TRIGGER room_task_tombstones_delete;
DROP TABLE room_task_tombstones;
