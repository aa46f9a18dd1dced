-- An attempt's prompts, newest last. An operator's resolution of an `unknown` turn reads its
-- attempt's last prompt (was it parked on one when the process died?); without this index it
-- read every prompt the audit keeps (a week of approvals and questions by default) and sorted
-- them.
CREATE INDEX prompts_attempt ON prompts(admission_id, execution_generation, opened_at);
