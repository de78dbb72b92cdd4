"""The OpenAI- and Anthropic-compatible HTTP frontend, in rooms that import one way (each only from the rooms
listed before it):

- ``http/``: the HTTP floor: the server and its connection limits, ASGI helpers, the error
  boundary, API keys, rate and body limits, the doors every request passes (``request_checks``),
  the processes sharing one port (``port_sharing``) and their summed ``/metrics``.
- ``parsers/`` and ``preprocess/``: tool-call and reasoning parsers, tokenizer, chat template,
  detokenizer and stop strings; shared by every API surface, importing no other room.
- ``pipeline/``: one request from the door to the engines and back: ``FrontendRequest`` (made at
  the door) and ``EngineRequest`` (one generation), ``serve`` (the door, admission and the one
  serve loop, with a ``ResponseWriter`` per output format), dispatch and migration, routing,
  prefill, the model registry, metrics, the process state and worker health.
- ``openai/``: the OpenAI surface: its schema, chat, completions, the Responses API
  (``responses/``), embeddings, the output formatters and writers, the fan-out of ``n > 1``.
- ``anthropic/``: the Anthropic Messages API (``/v1/messages``, ``count_tokens``): its schema, the
  conversion to a chat request (so the chat plan, template, parsers and guided decoding serve it),
  content blocks and events, its writers and error shape.
- ``app.py`` (the route table) and ``main.py`` (``dynamod --role frontend``) assemble them.
"""
