"""The SGLang engine adapter: ``sglang.Engine`` behind the Engine Protocol (needs CUDA; SGLang is
imported only when the engine starts). KV events use the vLLM adapter's ZMQ subscriber with
SGLang's array-shaped event decoding (kv_format.py)."""
