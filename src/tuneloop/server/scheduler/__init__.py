"""Scheduling: per-model ordering by seq_id, batching policy, the engine loop, the future table."""
