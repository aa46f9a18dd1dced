-- 000014 makes the index too: nothing to undo here.
SELECT 1;
