"""Operator actions (drain, sleep, wake, LoRA load/unload, clear KV), shared by the TUI and dynamoctl."""
