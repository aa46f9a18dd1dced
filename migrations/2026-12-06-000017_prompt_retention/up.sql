-- Ended prompts (the audit of approvals and questions) age out with the event log: the pruner
-- reaches the oldest ended ones through this index, never the open ones.
CREATE INDEX prompts_resolved ON prompts(resolved_at) WHERE resolved_at IS NOT NULL;
