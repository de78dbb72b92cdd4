"""``dynamoctl``: every console action as a plain command for scripts and SSH sessions."""
