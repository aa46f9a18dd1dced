DROP TABLE room_owners;
