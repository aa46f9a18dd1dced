-- The model's reasoning (`reasoning_content`) for an assistant message: stored with it and sent
-- back with it on later requests, as the model produced it. Adding a nullable column rewrites no
-- row: existing messages have none.
ALTER TABLE messages ADD COLUMN reasoning TEXT;
