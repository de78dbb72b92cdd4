"""What every tool that runs a fleet needs, whoever runs it: the ``dynamoctl cluster`` inventory
and the SSH start/stop of a role (used by dynamoctl and by the planner's SSH connector), and the
count of ready workers per planner pool read from discovery (used by the planner's connectors and
the ``dynamod up`` supervisor)."""
