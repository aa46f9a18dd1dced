DROP INDEX prompts_resolved;
