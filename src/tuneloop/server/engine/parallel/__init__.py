"""Base-model weights sharded across the ranks of a worker group (torch.distributed FSDP2)."""

from tuneloop.server.engine.parallel.fsdp import ShardedWeights, local_bytes, shard_model

__all__ = ["ShardedWeights", "local_bytes", "shard_model"]
