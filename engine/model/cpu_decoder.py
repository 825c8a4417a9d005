"""PrefixGate's own forward of a Llama decoder on the CPU, with fewer and fused operators.

transformers' modeling code runs about 35 torch operators per layer (three projections, the
views and transposes around them, RoPE as ten element-wise ops, residual adds, norms, the MLP)
through several Python module calls each. In a one-sequence decode step each operator's
dispatch outweighs its arithmetic on a few kilobytes of data, so the operators and Python
around them, not the arithmetic, took as long as the matrix products.

`LlamaDecoder` runs the same computation as `LlamaForCausalLM` with about ten operators a layer:
one projection for Q, K and V and one for gate and up (their weights concatenated once; the
model's own parameters become views into them, so no weight is held twice), RoPE in place on
the fused projection (`rotary_`), the residual add fused into the next norm (`add_rms_norm_`),
and SiLU-and-multiply on the fused gate-and-up product (`gated_silu`), all in
`elementwise.cpp`, rounding where transformers' bf16 operators round. The rotary tables come
from the model's own rotary module, so RoPE scaling variants stay the model's. Attention goes
through the same backend as before.

Only plain Llama models are taken (`model_type` "llama", SiLU, every norm and MLP already
fused by `engine.kernels.cpu.fused`); everything else keeps transformers' forward.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.attention.paged import PagedBatch, write_and_attend
from engine.kernels.cpu.fused import FusedMLP, FusedRMSNorm
from engine.kernels.cpu.linear import MatrixLinear


class DecoderLayer(torch.nn.Module):
    """One layer's weights, as `LlamaDecoder` uses them."""

    def __init__(
        self, layer: torch.nn.Module, fused_qkv: torch.nn.Linear, fused_gate_up: torch.nn.Linear
    ) -> None:
        super().__init__()
        attention: Any = layer.get_submodule("self_attn")
        self.qkv_proj = fused_qkv
        self.o_proj: torch.nn.Module = attention.get_submodule("o_proj")
        self.gate_up_proj = fused_gate_up
        self.down_proj: torch.nn.Module = layer.get_submodule("mlp").get_submodule("down_proj")
        self.input_norm: FusedRMSNorm = layer.get_submodule("input_layernorm")  # type: ignore[assignment]
        self.post_norm: FusedRMSNorm = layer.get_submodule("post_attention_layernorm")  # type: ignore[assignment]
        self.layer_index = int(attention.layer_idx)
        self.scaling = float(attention.scaling)

    def activated(self, normed: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of the fused gate-and-up projection: one pass where it runs on the
        matrix kernel and its halves are whole tiles (`MatrixLinear.gated_silu`)."""
        projection = self.gate_up_proj
        if isinstance(projection, MatrixLinear) and projection.out_features % 128 == 0:
            return projection.gated_silu(normed)
        gated: torch.Tensor = torch.ops.prefixgate.gated_silu(projection(normed))
        return gated


class LlamaDecoder(torch.nn.Module):
    """Embeddings, decoder layers, final norm and LM head of a Llama model, run on a packed
    paged batch (see the module's docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        config: Any = model.config
        inner = model.get_submodule("model")
        self.embed_tokens: torch.nn.Module = inner.get_submodule("embed_tokens")
        self.rotary_emb: torch.nn.Module = inner.get_submodule("rotary_emb")
        self.norm: FusedRMSNorm = inner.get_submodule("norm")  # type: ignore[assignment]
        self.lm_head: torch.nn.Module = model.get_submodule("lm_head")
        self.q_heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.layers: list[DecoderLayer] = [
            DecoderLayer(
                layer,
                _fuse(layer.get_submodule("self_attn"), ("q_proj", "k_proj", "v_proj")),
                _fuse(layer.get_submodule("mlp"), ("gate_proj", "up_proj")),
            )
            for layer in inner.get_submodule("layers").children()
        ]
        self.registered = torch.nn.ModuleList(self.layers)  # so that `modules()` sees them

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logit_rows: torch.Tensor,
        batch: PagedBatch,
    ) -> torch.Tensor:
        """Logits of `logit_rows` for the packed tokens `input_ids` at `positions`; new K/V
        are written into the batch's pool slots."""
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(hidden[None], positions[None])
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        tokens = hidden.shape[0]
        q_width = self.q_heads * self.head_dim
        kv_width = self.kv_heads * self.head_dim
        residual = hidden  # the embedding's output, a tensor of its own: added into in place
        normed = self.layers[0].input_norm(hidden) if self.layers else hidden
        for index, layer in enumerate(self.layers):
            if index:
                normed = torch.ops.prefixgate.add_rms_norm_(
                    residual, hidden, layer.input_norm.weight, layer.input_norm.variance_epsilon
                )
            qkv = project(layer.qkv_proj, normed)
            torch.ops.prefixgate.rotary_(qkv, cos, sin, self.q_heads + self.kv_heads, self.head_dim)
            query = qkv[:, :q_width].view(tokens, self.q_heads, self.head_dim)
            key = qkv[:, q_width : q_width + kv_width].view(tokens, self.kv_heads, self.head_dim)
            value = qkv[:, q_width + kv_width :].view(tokens, self.kv_heads, self.head_dim)
            attended = write_and_attend(
                batch, layer.layer_index, query, key, value, layer.scaling, None
            )
            hidden = project(layer.o_proj, attended.reshape(tokens, q_width))
            normed = torch.ops.prefixgate.add_rms_norm_(
                residual, hidden, layer.post_norm.weight, layer.post_norm.variance_epsilon
            )
            hidden = project(layer.down_proj, layer.activated(normed))
        normed = torch.ops.prefixgate.add_rms_norm_(
            residual, hidden, self.norm.weight, self.norm.variance_epsilon
        )
        return project(self.lm_head, normed[logit_rows])


def project(linear: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """`linear(rows)` for [tokens, features] rows: a `MatrixLinear`'s kernel called directly
    where the rows are contiguous (`MatrixLinear.rows`), without nn.Module's call and the
    reshapes around the kernel, a large part of a one-row projection's time (a decode step runs
    91 such calls, and 30 gate-and-up products through `gated_silu`, whose reshapes
    `MatrixLinear` also skips for such rows)."""
    if type(linear) is MatrixLinear and rows.dim() == 2 and rows.is_contiguous():
        return linear.rows(rows, linear.fp32_out)
    output: torch.Tensor = linear(rows)
    return output


def _fuse(parent: torch.nn.Module, names: tuple[str, ...]) -> torch.nn.Linear:
    """One `nn.Linear` computing `parent`'s linears `names` side by side. The originals' weights
    (and biases) become views into the fused ones, so the model holds each weight once and its
    own forward and `state_dict` are unchanged."""
    parts: list[torch.nn.Linear] = [parent.get_submodule(name) for name in names]  # type: ignore[misc]
    weight = torch.cat([part.weight.detach() for part in parts])
    bias = None
    if parts[0].bias is not None:
        bias = torch.cat([part.bias.detach() for part in parts if part.bias is not None])
    fused = torch.nn.Linear(
        weight.shape[1],
        weight.shape[0],
        bias=bias is not None,
        dtype=weight.dtype,
        device=weight.device,
    )
    fused.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = torch.nn.Parameter(bias, requires_grad=False)
    start = 0
    for part in parts:
        end = start + part.out_features
        part.weight = torch.nn.Parameter(weight[start:end], requires_grad=False)
        if bias is not None:
            part.bias = torch.nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    return fused


def llama_decoder(model: torch.nn.Module) -> LlamaDecoder | None:
    """PrefixGate's own forward for `model` where it takes it (a plain Llama on the CPU whose
    norms and MLPs `fuse_elementwise` swapped), else None. Made once per model: a runner made
    again (a restart) gets the same one."""
    made = getattr(model, "_prefixgate_decoder", None)
    if isinstance(made, LlamaDecoder):
        return made
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) != "llama":
        return None
    if getattr(config, "hidden_act", None) != "silu":
        return None
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if (
        inner is None
        or layers is None
        or not isinstance(getattr(inner, "norm", None), FusedRMSNorm)
    ):
        return None
    for layer in layers:
        if not (
            isinstance(layer.input_layernorm, FusedRMSNorm)
            and isinstance(layer.post_attention_layernorm, FusedRMSNorm)
            and isinstance(layer.mlp, FusedMLP)
            and all(
                type(getattr(layer.self_attn, name, None)) is torch.nn.Linear
                for name in ("q_proj", "k_proj", "v_proj", "o_proj")
            )
        ):
            return None
    decoder = LlamaDecoder(model)
    object.__setattr__(model, "_prefixgate_decoder", decoder)  # not a submodule of the model
    return decoder
