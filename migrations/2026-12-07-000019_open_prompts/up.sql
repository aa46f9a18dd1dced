-- The prompts still open, in the order they were opened. A start closes the ones an earlier
-- process left open (`prompts::close_abandoned`); without this index it read every prompt kept
-- for the audit (a week of approvals and questions by default) to find them, twice.
CREATE INDEX prompts_open ON prompts(opened_at) WHERE resolved_at IS NULL;
