DROP TABLE session_approvals;
DROP TABLE approval_allowlist;
DROP TABLE prompts;
DROP TABLE messages;
DROP TABLE session_admissions;
DROP TABLE sessions;
DROP TABLE state_meta;
DROP TABLE runtime_epoch;
