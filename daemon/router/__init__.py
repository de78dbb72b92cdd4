"""The standalone router role (``dynamod --role router``): serves routing decisions to workers'
clients over the request plane (service.py) with its own prefill pool (prefill_pool.py).

The routing itself is the router core library (daemon/router/core/), which the frontend embeds
too; this package is only the role around it.
"""
