"""The planner role: sizes the worker pools of one namespace to the load (``load``) or to TTFT/ITL
targets (``sla``), and carries its decisions out through a connector."""
