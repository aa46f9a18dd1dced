-- An `always` approval is its principal's: one API key's user approving a rule for good no longer
-- approves it for every other key's sessions. Rows of approval_allowlist (kept before this) stay
-- as they were: for every principal.
CREATE TABLE principal_approvals (
    principal_id TEXT NOT NULL,
    pattern_key TEXT NOT NULL,
    created_at DOUBLE NOT NULL,
    PRIMARY KEY (principal_id, pattern_key)
) WITHOUT ROWID;
