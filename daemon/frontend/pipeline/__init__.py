"""One request through the frontend: the request objects, the door and ``serve``, dispatch to the
workers (routing, prefill, migration), the models, metrics and state. Built on ``http/``; knows no
API surface (``openai/`` and its siblings build on it)."""
