-- The index the pruner of chat_threads reads its oldest records through. It was added to
-- 000014 after that migration had been committed: a store migrated before has the table
-- without it, and each prune scanned and sorted the whole table inside the writer's
-- transaction. Made here for such a store; a store that has it keeps it.
CREATE INDEX IF NOT EXISTS chat_threads_age ON chat_threads(created_at);
