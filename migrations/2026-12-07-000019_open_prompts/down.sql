DROP INDEX prompts_open;
