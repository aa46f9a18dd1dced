DROP TRIGGER room_task_counts_delete;
DROP TRIGGER room_task_counts_update;
DROP TRIGGER room_task_counts_insert;
DROP TABLE room_task_counts;
