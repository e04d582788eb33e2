"""The drafter's layers: norm, rotary embedding, KV-injection attention, MLP, the dynamic convolution, a decoder layer.
The norm, rotary embedding and MLP are Qwen3's own (the official checkpoint's layers are Qwen3's).

Each layer reads ``config`` and its ``layer_idx`` (transformers' modeling style); ``modeling_dflash2`` stacks them.
Queries come from the block only; keys and values are ``[k_proj(context); k_proj(block)]`` (the target's features
injected as K/V), non-causal inside the block. DFlash 2's two-tap grouped dynamic causal convolution runs before
("prepare") and after ("finish") each sublayer, reset at every block.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, eager_attention_forward, rotate_half

from .configuration_dflash2 import DFlash2Config


class DFlash2RMSNorm(Qwen3RMSNorm):
    """Qwen3's RMSNorm: ``weight * x / rms(x)``, the statistics in fp32."""


class DFlash2RotaryEmbedding(Qwen3RotaryEmbedding):
    """Qwen3's rotary embedding (rotate-half, any transformers RoPE type) at the drafter's own positions."""

    def compute_inv_freq(self) -> torch.Tensor:
        """The non-persistent ``inv_freq`` again (``from_pretrained`` builds on meta: ``_init_weights`` refills it)."""
        init = self.compute_default_rope_parameters if self.rope_type == "default" else ROPE_INIT_FUNCTIONS[self.rope_type]
        return init(self.config)[0]


def is_flash_attention(implementation: str | None) -> bool:
    """flash_attention_2/3, paged or hub-kernel flash variants: kernels that take no arbitrary mask."""
    return implementation is not None and "flash" in implementation


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, heads, t, hd]; cos/sin: [b, t, hd] at the true positions of those t tokens."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


def block_attention_mask(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    sliding_window: int | None = None,
    causal: bool = False,
    fixed: bool = False,
) -> torch.Tensor | None:
    """Inference mask: block queries see every key (context and the whole block), minus padding and
    keys that fell out of the sliding window, and (``causal``) block keys after the query. Returns
    ``None`` when nothing is masked, unless ``fixed`` (a compiled step: always a mask, decided without
    reading the data on the host).

    query_positions [b, q], key_positions [b, kv], key_padding_mask [b, kv] (1 = real token).
    """
    mask = None
    distance = query_positions[:, :, None] - key_positions[:, None, :]  # [b, q, kv]
    if sliding_window is not None:
        mask = distance < sliding_window
    if causal:
        mask = distance >= 0 if mask is None else mask & (distance >= 0)
    if key_padding_mask is not None and (fixed or not bool(key_padding_mask.all())):
        pad = key_padding_mask.bool()[:, None, :]  # [b, 1, kv]
        mask = pad if mask is None else mask & pad
    if mask is None or (not fixed and bool(mask.all())):
        return None
    return mask[:, None].expand(-1, 1, query_positions.shape[1], -1)  # [b, 1, q, kv]


class DFlash2Attention(nn.Module):
    """Qwen3-style attention whose keys/values are ``[context; block]`` and whose queries are the block."""

    def __init__(self, config: DFlash2Config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = False
        self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)
        self.q_norm = DFlash2RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = DFlash2RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> torch.Tensor:
        b, q_len, _ = hidden_states.shape
        kv_input = hidden_states if context is None else torch.cat([context, hidden_states], dim=1)  # [b, c+q, H]
        query = self.q_norm(self.q_proj(hidden_states).view(b, q_len, -1, self.head_dim)).transpose(1, 2)  # [b, h, q, hd]
        key = self.k_norm(self.k_proj(kv_input).view(b, kv_input.shape[1], -1, self.head_dim)).transpose(1, 2)  # [b, kvh, c+q, hd]
        value = self.v_proj(kv_input).view(b, kv_input.shape[1], -1, self.head_dim).transpose(1, 2)  # [b, kvh, c+q, hd]
        cos, sin = position_embeddings  # [b, c+q, hd]: context tokens at their true positions, then the block
        query = apply_rotary(query, cos[:, -q_len:], sin[:, -q_len:])
        key = apply_rotary(key, cos, sin)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)  # [b, kvh, past+c+q, hd]
        if attention_mask is not None and attention_mask.shape[-1] != key.shape[-2]:
            attention_mask = attention_mask[..., -key.shape[-2] :]  # a cache layer that keeps only its window
        interface: Callable = eager_attention_forward  # Qwen3's: it adds the mask, so a boolean one becomes additive
        implementation = self.config._attn_implementation
        if attention_mask is not None and is_flash_attention(implementation):
            implementation = "sdpa"  # flash kernels read a 4D mask as a padding mask: masked blocks go through SDPA
        if implementation not in (None, "eager"):
            interface = ALL_ATTENTION_FUNCTIONS[implementation]
        elif attention_mask is not None and attention_mask.dtype == torch.bool:
            attention_mask = torch.where(attention_mask, 0.0, torch.finfo(query.dtype).min).to(query.dtype)
        attn_output, _ = interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            is_causal=False,
            **kwargs,
        )
        return self.o_proj(attn_output.reshape(b, q_len, -1))  # [b, q, H]


class DFlash2MLP(Qwen3MLP):
    """Qwen3's gated MLP: ``down(act(gate(x)) * up(x))``."""

    def __init__(self, config: DFlash2Config, layer_idx: int | None = None):
        super().__init__(config)


class DFlash2DynamicConv(nn.Module):
    """Grouped dynamic causal convolution over block positions (DFlash 2, SPEC 2a).

        conv(v)_t = sum_j (base[stage, j] + dyn[t, stage, j, group(c)]) * v_{t-j},   v_{t-j} := 0 before the block

    ``stage`` 0 = prepare (before the sublayer), 1 = finish (after it). Both stages' dynamic
    coefficients come from one projection of the sublayer's normed input. ``group_size``
    channels share one coefficient. Identity at init: base[:, 0] = 1, base[:, 1:] = 0, projection = 0.
    """

    def __init__(self, config: DFlash2Config, layer_idx: int):
        super().__init__()
        self.kernel_size = config.conv_kernel_size
        self.group_size = config.conv_group_size
        self.num_groups = config.hidden_size // config.conv_group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, self.kernel_size, config.hidden_size))
        self.kernel_projection = nn.Linear(config.hidden_size, 2 * self.kernel_size * self.num_groups, bias=False)

    def kernels(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-position kernels (prepare, finish), each ``[b, t, kernel_size, H]``, from the normed input h."""
        b, t, hidden = h.shape
        dyn = self.kernel_projection(h).view(b, t, 2, self.kernel_size, self.num_groups)  # [b, t, 2, k, G]
        dyn = dyn.repeat_interleave(self.group_size, dim=-1)  # [b, t, 2, k, H]
        kernel = self.base_kernel + dyn  # [b, t, 2, k, H]
        return kernel[:, :, 0], kernel[:, :, 1]

    @staticmethod
    def apply(v: torch.Tensor, kernel: torch.Tensor, block_size: int) -> torch.Tensor:
        """v: [b, t, H] with t a multiple of block_size; kernel: [b, t, k, H]. Block-local causal taps."""
        b, t, hidden = v.shape
        blocks = v.view(b, t // block_size, block_size, hidden)  # [b, n, B, H]
        out = kernel[:, :, 0] * v
        for j in range(1, kernel.shape[2]):
            shifted = F.pad(blocks, (0, 0, j, 0))[:, :, :block_size]  # [b, n, B, H]: v_{t-j}, zeros before the block
            out = out + kernel[:, :, j] * shifted.reshape(b, t, hidden)
        return out


class DFlash2DecoderLayer(nn.Module):
    def __init__(self, config: DFlash2Config, layer_idx: int):
        super().__init__()
        self.block_size = config.block_size
        self.self_attn = DFlash2Attention(config, layer_idx)
        self.mlp = DFlash2MLP(config, layer_idx)
        self.input_layernorm = DFlash2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DFlash2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention_conv = DFlash2DynamicConv(config, layer_idx) if config.use_conv else None
        self.mlp_conv = DFlash2DynamicConv(config, layer_idx) if config.use_conv else None

    def _sublayer(self, x, norm, fn, conv, block_size):
        h = norm(x)
        if conv is None:
            return x + fn(h)
        prepare, finish = conv.kernels(h)
        return x + conv.apply(fn(conv.apply(h, prepare, block_size)), finish, block_size)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        past_key_values: Cache | None = None,
        block_size: int | None = None,
        **kwargs,
    ) -> torch.Tensor:
        block_size = block_size or self.block_size

        def attend(h):
            return self.self_attn(h, context, position_embeddings, attention_mask, past_key_values, **kwargs)

        hidden_states = self._sublayer(hidden_states, self.input_layernorm, attend, self.attention_conv, block_size)
        return self._sublayer(hidden_states, self.post_attention_layernorm, self.mlp, self.mlp_conv, block_size)


__all__ = ["DFlash2Attention", "DFlash2DecoderLayer", "DFlash2DynamicConv", "DFlash2MLP", "DFlash2RMSNorm", "DFlash2RotaryEmbedding",
           "block_attention_mask"]
