-- idem: nothing on SQLite, whose reservation reads first in its own
-- transaction already. The version keeps both stores' schema versions the
-- same (PostgreSQL gets its single-value reservation function here).
SELECT 1;
