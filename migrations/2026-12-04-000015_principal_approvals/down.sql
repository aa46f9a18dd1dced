DROP TABLE principal_approvals;
