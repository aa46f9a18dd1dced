DROP INDEX prompts_attempt;
