"""The OpenAI API surface on the pipeline: schema, ``/v1/chat/completions``, ``/v1/completions``,
``/v1/responses``, ``/v1/embeddings``, their formatters and writers, and the fan-out of ``n > 1``."""
