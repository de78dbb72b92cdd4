"""KV block transfer between workers (disaggregated serving): registered block memory, agents that
read remote blocks into local ones (NIXL over UCX, or our TCP block transport), and the factory
that picks one. See ``dynamod.shared.protocol.kv_transfer`` for the flow and the wire types."""
