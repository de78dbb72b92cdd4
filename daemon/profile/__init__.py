"""``dynamod profile``: measure an engine and write the performance profile the SLA planner reads."""
