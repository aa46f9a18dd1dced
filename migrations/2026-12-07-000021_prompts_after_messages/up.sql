-- The newest message's id when a prompt opened. Whether anything of its turn was recorded after
-- it (an operator resolving a turn lost at a crash: was it parked on this prompt?) is read by
-- message id, which only grows, not by comparing wall-clock times: a clock stepped back between
-- the prompt and a later message of its turn made that message look older, and a call that may
-- have run was said not to have. Adding a nullable column rewrites no row: prompts opened before
-- it keep NULL, and their times are compared as before.
ALTER TABLE prompts ADD COLUMN after_message_id BIGINT;

-- An attempt's prompts, newest last by the same measure (the resolution reads the last one).
DROP INDEX prompts_attempt;
CREATE INDEX prompts_attempt ON prompts(admission_id, execution_generation, after_message_id, opened_at);
