ALTER TABLE messages DROP COLUMN reasoning;
