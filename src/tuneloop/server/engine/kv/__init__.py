"""The sampler's paged KV cache: a block pool, a block manager, paged attention."""
