"""The global router role: picks a pool (a namespace with its own router and workers) per request.

``config`` reads Dynamo's grid config file, ``pool_selection`` turns a request's length, SLA targets
and priority into a pool (pure), ``service`` serves the frontend-facing endpoints and forwards to the
chosen pool's router with retry before the first output, ``main`` is ``dynamod --role global-router``.
"""
