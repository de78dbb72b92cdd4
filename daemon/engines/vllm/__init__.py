"""The vLLM engine adapter: a real vLLM ``AsyncLLM`` behind the Engine Protocol.

Modules: ``adapter`` (factory entry points), ``engine`` (``VllmEngine``), ``flags`` (vLLM's own
flags passed through), ``outputs`` (sampling and output mapping), ``stats`` (load from scheduler
stats). The native KV event path, flag helpers and LoRA source checks it shares with the other
engine adapters live in daemon/engines/common/.

Nothing here imports vLLM at module level: the package imports on machines without it.
"""
