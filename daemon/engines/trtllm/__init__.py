"""The TensorRT-LLM engine adapter: ``tensorrt_llm.LLM`` behind the Engine Protocol (needs CUDA;
TensorRT-LLM is imported only when the engine starts). KV cache events come from the LLM API's
event queue (kv_format.py maps them)."""
