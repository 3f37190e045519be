"""The engine as a group of worker processes behind the same `Backend` protocol.

`group.WorkerGroupBackend` runs in the server process and holds no model: it shards each
forward_backward batch across N workers (one per device), spreads sampling requests over them,
keeps every adapter's state after each optim_step in host memory, and restarts the group when a
worker dies, restoring adapters and samplers and re-running the call that was in flight. Each
worker (`worker.py`) owns a `TorchBackend` and joins a torch.distributed process group, in which
LoRA gradients are all-reduced before every rank applies the same AdamW step. `placement.py`
starts the workers as local processes; `ray_placement.py` as Ray actors.
"""

from __future__ import annotations
