"""``dynamod up``: a supervised single-host cluster (frontend + workers) with no external servers."""
