DROP INDEX room_tasks_ended;
