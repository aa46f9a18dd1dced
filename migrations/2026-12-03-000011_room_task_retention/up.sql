-- Rooms prune their ended tasks (`rooms.task_retention_seconds`, `rooms.max_ended_tasks_per_room`):
-- the ended tasks of a room in the order they ended, which is what the pruner walks, by age and
-- past the newest ones a room keeps. Only ended tasks are in it, so a task that is queued or
-- running costs it nothing, and a settlement one index entry.
--
-- The statuses are spelled as ORs, not an IN list: SQLite checks an IN list of three or more
-- constants through a temporary table, on every write to the table that it has to evaluate for.
CREATE INDEX room_tasks_ended ON room_tasks (room_id, terminal_at)
    WHERE (status = 'settled' OR status = 'failed' OR status = 'cancelled');
