DROP INDEX prompts_attempt;
CREATE INDEX prompts_attempt ON prompts(admission_id, execution_generation, opened_at);
ALTER TABLE prompts DROP COLUMN after_message_id;
