"""``dynamoctl cluster``: start, stop, check and read logs of dynamod roles on hosts over SSH."""
