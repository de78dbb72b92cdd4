"""The Anthropic Messages API surface: ``POST /v1/messages`` and ``/v1/messages/count_tokens``
(schema, conversion to the chat pipeline, content blocks and events, writers, errors)."""
