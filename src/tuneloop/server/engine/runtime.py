"""One resident base model with its adapter bank and, once it samples, its paged decoder."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tuneloop.server.engine import decode_layers
from tuneloop.server.engine.decoder import Decoder
from tuneloop.server.engine.kv import decode_attention, native_decode
from tuneloop.server.engine.kv.paged_attention import FLASH_BLOCK_SIZE, kernel_available
from tuneloop.server.engine.lora import AdapterBank
from tuneloop.server.engine.memory import attention_heads, kv_cache_blocks
from tuneloop.server.engine.models import LoadedModel

__all__ = ["DEFAULT_BLOCK_SIZE", "Runtime"]

# Tokens per KV block on the reference path: small blocks share more of a prompt between
# samples and waste less at each sequence's end (vLLM's default); the CUDA kernel needs 256.
DEFAULT_BLOCK_SIZE = 16


@dataclass
class Runtime:
    loaded: LoadedModel
    bank: AdapterBank
    pad_id: int
    packed: bool = False  # training batches packed end to end (see packing.py)
    tokenizer: Any = None
    decoder: Decoder | None = None  # made at the first sampling request: a KV pool is large
    # Decode rows attend with a CPU kernel once `compile_decode` found one: the native one
    # (kv/native_decode.py) or inductor's (kv/decode_attention.py).
    decode_kernel: Callable[..., torch.Tensor] | None = None
    # The decoder layers as one lean loop for sampling steps on one key's fused weights
    # (decode_layers.py), where the model qualifies once `compile_decode` picked the native
    # attention.
    layers_plan: decode_layers.Plan | None = None

    @property
    def compiled_decode(self) -> bool:
        """Whether decode rows attend with a CPU kernel (`compile_decode` found one)."""
        return self.decode_kernel is not None

    @property
    def model(self) -> nn.Module:
        return self.loaded.model

    @property
    def device(self) -> torch.device:
        return next(self.loaded.model.parameters()).device

    def decode(self, tokens: list[int]) -> str:
        if self.tokenizer is None:
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(
                str(self.loaded.spec.tokenizer_dir / "tokenizer.json")
            )
        return str(self.tokenizer.decode(tokens, skip_special_tokens=False))

    def sampling_decoder(
        self,
        token_budget: int | None,
        prefill_chunk: int,
        block_size: int | None = None,
        merge_lone_adapter: bool = False,
        fuse_lone_key: bool = False,
        graphs: bool = False,
    ) -> Decoder:
        """This model's decoder, made on first use with a pool of `token_budget` tokens (None:
        sized from the memory free then, memory.kv_cache_tokens), and made again, while idle,
        if the budget or block size asked for changed."""
        kernel = kernel_available(self.device, next(self.model.parameters()).dtype)
        size = block_size or (FLASH_BLOCK_SIZE if kernel else DEFAULT_BLOCK_SIZE)
        decoder = self.decoder
        if (
            decoder is not None
            and not len(decoder)
            and (decoder.budget, decoder.blocks.block_size) != (token_budget, size)
        ):
            decoder = None
        if decoder is None:
            param = next(self.model.parameters())
            blocks = kv_cache_blocks(
                self.model.config, param.dtype, param.device, size, token_budget
            )
            decoder = Decoder(
                self.model,
                self.bank,
                num_blocks=blocks,
                block_size=size,
                pad_id=self.pad_id,
                decode=self.decode,
                kernel=kernel,
            )
            decoder.budget = token_budget
            self.decoder = decoder
        decoder.prefill_chunk = max(1, prefill_chunk)
        lone = "merged" if merge_lone_adapter else "fused" if fuse_lone_key else None
        decoder.runner.lone_weights = lone
        decoder.runner.decode_kernel = self.decode_kernel
        decoder.runner.layers = self.layers_plan
        decoder.runner.use_graphs(graphs, capture=self.device.type == "cuda")
        return decoder

    def compile_decode(self) -> bool:
        """Pick the decode rows' attention kernel for this model's heads: the native one where
        it takes them (bf16 on a CPU with AVX512-BF16, fp32 on one with AVX2 and FMA), else
        inductor's, warmed up; whether either is used."""
        heads, kv_heads, dim = attention_heads(self.model.config)
        dtype = next(self.model.parameters()).dtype
        if native_decode.available(heads, kv_heads, dim, dim, dtype, self.device):
            self.decode_kernel = native_decode.attend
            self.layers_plan = decode_layers.plan(self.model)
            return True
        # The scale the attention modules pass (Gemma's is not 1 / sqrt(head size)).
        scales = (getattr(m, "scaling", None) for m in self.model.modules())
        scale = next((s for s in scales if isinstance(s, float)), dim**-0.5)
        warm = decode_attention.warm_up(heads, kv_heads, dim, dim, scale, dtype, self.device)
        self.decode_kernel = decode_attention.compiled() if warm else None
        return warm
