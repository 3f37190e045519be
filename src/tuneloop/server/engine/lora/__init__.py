"""Multi-tenant LoRA over one frozen base model: adapters as slots of the model's own modules.

- `targets`: which layers are adapted per target group (attention, mlp, experts, unembed), the
  coverage of the model's weights, and refusal of models with layers it cannot adapt;
- `linear` / `experts`: the adapted layers (`nn.Linear`; fused 3-D MoE expert weights);
- `slots`: the per-adapter parameter slots they share;
- `routing` / `ops`: which adapter each row uses, and the segment matmuls (kernel seam);
- `bank`: creating, snapshotting, loading, saving and deleting adapters at run time.
"""

from tuneloop.server.engine.lora.bank import AdapterBank, peft_keys, peft_targets
from tuneloop.server.engine.lora.experts import LoRAExperts
from tuneloop.server.engine.lora.linear import LoRALinear
from tuneloop.server.engine.lora.routing import Routing
from tuneloop.server.engine.lora.targets import (
    ATTENTION_TARGETS,
    GROUPS,
    MLP_TARGETS,
    UNEMBED_TARGETS,
    Coverage,
    Injected,
    groups_of,
    inject,
    targets_of,
)

__all__ = [
    "ATTENTION_TARGETS",
    "GROUPS",
    "MLP_TARGETS",
    "UNEMBED_TARGETS",
    "AdapterBank",
    "Coverage",
    "Injected",
    "LoRAExperts",
    "LoRALinear",
    "Routing",
    "groups_of",
    "inject",
    "peft_keys",
    "peft_targets",
    "targets_of",
]
