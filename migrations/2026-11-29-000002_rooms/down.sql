DROP INDEX IF EXISTS room_tasks_room_order;
DROP TABLE IF EXISTS room_tasks;
DROP TABLE IF EXISTS room_leases;
DROP TABLE IF EXISTS room_events;
DROP TABLE IF EXISTS room_members;
DROP TABLE IF EXISTS rooms;
