"""The shape of a model's KV cache, and what it costs in bytes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(name: str) -> torch.dtype:
    """Map a dtype name such as `bf16` or `float32` to a torch dtype."""
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of a KV dtype, as it goes into the block-key root."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class KVSpec:
    """Layers, KV heads, head size, dtype and block size of a paged KV cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer for one token: 2 x layers x kv_heads x head_dim x dtype bytes."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size
