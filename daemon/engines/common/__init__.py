"""Engine-neutral pieces the engine adapters (vLLM, SGLang, TensorRT-LLM) share.

``flags`` (an engine's own command-line tokens), ``lora`` (local adapter directories), ``sampling``
(stop settings every engine takes), and the native KV event path: ``kv_endpoints`` (who binds
where), ``kv_subscriber`` (ordered ZMQ batches with replay and gap detection), ``native_events``
(vLLM/SGLang hash quirks: native events rehashed the router's way), ``native_kv`` (numbered router
events) and ``kv_table`` (the blocks held, for ``kv_dump``); ``disagg`` (roles, request stages and
JSON-safe parameters for prefill/decode disaggregation).

Nothing here imports an engine: the package imports on machines without any.
"""
