"""Connectors carry the planner's replica counts out on one kind of fleet: ``local`` (the ``dynamod
up`` supervisor), ``ssh`` (hosts of a ``dynamoctl cluster`` inventory), ``virtual`` (counts written
to discovery for an external orchestrator), ``kubernetes`` (the apps/v1 scale subresource)."""
