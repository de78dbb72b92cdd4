"""The vLLM engine adapter: a real vLLM ``AsyncLLM`` behind the Engine Protocol.

Modules: ``adapter`` (factory entry points), ``engine`` (``VllmEngine``), ``flags`` (vLLM's own
flags passed through), ``outputs`` (sampling and output mapping), ``stats`` (load from scheduler
stats), and the native KV event path shared with the SGLang adapter: ``kv_endpoints`` (who binds
where), ``kv_subscriber`` (ordered ZMQ batches with replay and gap detection), ``native_kv``
(numbered router events) and ``kv_table`` (the blocks held, for ``kv_dump``).

Nothing here imports vLLM at module level: the package imports on machines without it.
"""
