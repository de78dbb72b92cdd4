"""dynamod: distributed LLM serving with a terminal operator console.

The layers live in ``dynamod.shared`` (runtime library), ``dynamod.daemon`` (the roles) and
``dynamod.console`` (the Textual app and dynamoctl). Dependencies point at ``shared`` only.
"""

__version__ = "0.1.0"
