"""Performance models the roles share: a measured engine profile (profile.py, written by
``dynamod profile`` and read by the planner, the disaggregation policy and ``dynamod up``) and the
mocker's reference timing (mocker_timing.py, the simulated engine's step costs, which replay and the
cost policy's default predictions use). A library under the roles, so that the router core and the
planner need not import each other or the mocker engine."""
