"""Child-process helpers for the event plane integration tests (a publisher in another process)."""
