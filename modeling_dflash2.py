"""DFlash 2 block-diffusion drafter (Hugging Face remote code).

A drafter proposes a whole block ``[anchor, MASK, ..., MASK]`` in ONE forward pass,
conditioned on hidden states of a few target layers:

    ctx  = hidden_norm(fc([h_l1; ...; h_ln]))                 fused target features
    x    = target.embed_tokens(block)                         block inputs (target's table)
    per layer:  K/V = [k_proj(ctx); k_proj(block)]            KV injection of the context
                queries come from the block only; attention is non-causal inside the block
    h    = norm(x)                                            final drafter hidden
    logits = target.lm_head(h)                                draft logits (target's head)

DFlash 2 adds, in every layer, a two-tap grouped dynamic causal convolution before
("prepare") and after ("finish") each sublayer, reset at every block, and a
candidate selector that walks one coherent path through the per-position top-k.

Tensor names follow the official checkpoint schema exactly (``fc``, ``hidden_norm``,
``layers.N.{self_attn,mlp,attention_conv,mlp_conv,...}``, ``norm``,
``candidate_selector.{predecessor_codebook,successor_codebook,hidden_projection}``).
The target's embedding and LM head are passed in at call time and never stored.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import ModelOutput
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel

from .configuration_dflash2 import DFlash2Config
from .devices_dflash2 import execution_device, module_weights  # noqa: F401 (execution_device: part of this module's API)
from .selector_dflash2 import DFlash2CandidateSelector, DraftVocabHead, SelectorWalk, linear_head  # noqa: F401 (this module's API)
from .suffix_dflash2 import SuffixIndex
from .generation_dflash2 import dflash2_generate, install_assisted_generation_hook  # noqa: F401 (custom_generate uses it)


class DFlash2RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class DFlash2RotaryEmbedding(nn.Module):
    inv_freq: torch.Tensor

    def __init__(self, config: DFlash2Config):
        super().__init__()
        self.config = config
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        if self.rope_type == "default":
            inv_freq, self.attention_scaling = self.compute_default_rope_parameters(config)
        else:
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[self.rope_type](config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    def compute_inv_freq(self) -> torch.Tensor:
        if self.rope_type == "default":
            return self.compute_default_rope_parameters(self.config)[0]
        return ROPE_INIT_FUNCTIONS[self.rope_type](self.config)[0]

    @staticmethod
    def compute_default_rope_parameters(config: DFlash2Config, device=None, seq_len=None) -> tuple[torch.Tensor, float]:
        base = config.rope_parameters["rope_theta"]
        dim = config.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))
        return inv_freq, 1.0

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(x.device)  # [b, t, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [b, t, hd]
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def is_flash_attention(implementation: str | None) -> bool:
    """flash_attention_2/3, paged or hub-kernel flash variants: kernels that take no arbitrary mask."""
    return implementation is not None and "flash" in implementation


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, heads, t, hd]; cos/sin: [b, t, hd] at the true positions of those t tokens."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    b, kv_heads, t, hd = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None].expand(b, kv_heads, n_rep, t, hd)  # [b, kvh, rep, t, hd]
    return hidden_states.reshape(b, kv_heads * n_rep, t, hd)  # [b, h, t, hd]


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention. ``attention_mask``: boolean ``[b, 1, q, kv]`` (True = attend) or additive float."""
    key = repeat_kv(key, module.num_key_value_groups)  # [b, h, kv, hd]
    value = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling  # [b, h, q, kv]
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            attn_weights = attn_weights.masked_fill(~attention_mask, torch.finfo(attn_weights.dtype).min)
        else:
            attn_weights = attn_weights + attention_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = F.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value)  # [b, h, q, hd]
    return attn_output.transpose(1, 2).contiguous(), attn_weights  # [b, q, h, hd]


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
        interface: Callable = eager_attention_forward
        implementation = self.config._attn_implementation
        if attention_mask is not None and is_flash_attention(implementation):
            implementation = "sdpa"  # flash kernels read a 4D mask as a padding mask: masked blocks go through SDPA
        if implementation not in (None, "eager"):
            interface = ALL_ATTENTION_FUNCTIONS[implementation]
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


class DFlash2MLP(nn.Module):
    def __init__(self, config: DFlash2Config, layer_idx: int):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


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


@dataclass
class DFlash2Output(ModelOutput):
    """last_hidden_state: [b, q, H] final drafter hidden at every block position."""

    last_hidden_state: torch.Tensor | None = None
    past_key_values: Cache | None = None


class DFlash2PreTrainedModel(PreTrainedModel):
    config: DFlash2Config
    config_class = DFlash2Config
    base_model_prefix = ""
    main_input_name = "noise_embeds"
    supports_gradient_checkpointing = False
    _no_split_modules = ["DFlash2DecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = False
    _supports_attention_backend = True
    # a drafter generates nothing itself; transformers' ``get_compiled_call`` (the loop compiles the drafter step with
    # the target's compile config) reads a generation config's compile settings, and None means its defaults
    generation_config = None

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, DFlash2RMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, DFlash2DynamicConv):
            base = torch.zeros_like(module.base_kernel)
            base[:, 0] = 1.0  # identity: conv(v)_t = v_t, so a fresh layer equals a plain DFlash layer
            init.copy_(module.base_kernel, base)
            init.zeros_(module.kernel_projection.weight)
        elif isinstance(module, DFlash2RotaryEmbedding):
            # non-persistent buffers are not in the checkpoint: recompute them (from_pretrained builds on meta)
            inv_freq = module.compute_inv_freq()
            init.copy_(module.inv_freq, inv_freq)
            init.copy_(module.original_inv_freq, inv_freq)
        elif isinstance(module, DFlash2CandidateSelector):
            rank = module.predecessor_codebook.shape[1]
            init.normal_(module.predecessor_codebook, mean=0.0, std=rank**-0.25)
            init.normal_(module.successor_codebook, mean=0.0, std=rank**-0.25)
            init.zeros_(module.hidden_projection.weight)  # S = U at init: the walk starts as argmax drafting


class DFlash2DraftModel(DFlash2PreTrainedModel):
    """DFlash 2 drafter. Call it with block embeddings and raw target features; it returns block hiddens.

    The forward contract is the one transformers' built-in DFlash path uses
    (``speculation_type="dflash"``): ``noise_embeds`` [b, q, H] (the anchor and MASK tokens,
    embedded by the target), ``context_hidden_states`` [b, c, n*H] (the newly committed
    tokens' target features, concatenated over ``target_layer_ids``), ``position_ids``
    [b, c+q], an optional 2D ``attention_mask`` over past + c + q keys, and a cache that
    receives the context K/V (the caller crops the block's K/V back off).
    """

    _is_dflash2_drafter = True

    def __init__(self, config: DFlash2Config):
        super().__init__(config)
        n_ctx = len(config.target_layer_ids) if config.target_layer_ids else config.num_hidden_layers
        self.fc = nn.Linear(n_ctx * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = DFlash2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([DFlash2DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = DFlash2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = DFlash2RotaryEmbedding(config)
        self.candidate_selector = DFlash2CandidateSelector(config) if config.use_selector else None
        self.post_init()

    # The drafter has no embedding table of its own: it borrows the target's at call time.
    def get_input_embeddings(self):
        return None

    @property
    def suffix_index(self) -> SuffixIndex | None:
        """What the target wrote in earlier calls of this process (``suffix_dflash2.SuffixIndex``, made on first use:
        the last 2^20 tokens; none when the environment sets ``DFLASH2_SUFFIX_INDEX=0``); its proposals join the
        n-gram's. The one knob: ``.enabled = False`` (off; or assign None), ``.clear()``,
        ``drafter.suffix_index = SuffixIndex(max_tokens=N)`` (cap), ``.save(path)`` and
        ``drafter.suffix_index = SuffixIndex.load(path)``."""
        if "_suffix_index" not in self.__dict__:
            self.__dict__["_suffix_index"] = None if os.environ.get("DFLASH2_SUFFIX_INDEX", "1") == "0" else SuffixIndex()
        return self.__dict__["_suffix_index"]

    @suffix_index.setter
    def suffix_index(self, index: SuffixIndex | None) -> None:
        if index is not None and not isinstance(index, SuffixIndex):
            raise TypeError(f"drafter.suffix_index takes a SuffixIndex or None (off), got {type(index).__name__}")
        self.__dict__["_suffix_index"] = index

    def fuse_context(self, context_hidden_states: torch.Tensor) -> torch.Tensor:
        """[b, c, n*H] raw target features -> [b, c, H] fused context."""
        return self.hidden_norm(self.fc(context_hidden_states))

    def forward(
        self,
        noise_embeds: torch.Tensor,
        context_hidden_states: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        block_size: int | None = None,
        key_positions: torch.LongTensor | None = None,
        **kwargs,
    ) -> DFlash2Output:
        """
        noise_embeds: [b, q, H] block input embeddings (q = block_size, or n_blocks*block_size in training).
        context_hidden_states: [b, c, n*H] target features of tokens not yet in the cache (c may be 0).
        position_ids: [b, c+q] true positions of those context tokens, then of the block tokens.
        attention_mask: 2D [b, past+c+q] padding mask, or a ready 4D mask [b, 1, q, kv] (training).
        block_size: conv block length (defaults to config.block_size; q must be a multiple of it).
        key_positions: [b, kv] the position of the token in every slot of a preallocated (static) cache, whose
            slots are not "every committed token, then the block"; ``attention_mask`` [b, kv] then marks the
            slots that hold a token. The mask is then built without host reads (a compiled step).
        """
        b, q_len, _ = noise_embeds.shape
        block_size = block_size or self.config.block_size
        if q_len % block_size:
            raise ValueError(f"noise_embeds has {q_len} positions, not a multiple of block_size={block_size}")
        context = None
        if context_hidden_states is not None and context_hidden_states.shape[1] > 0:
            context = self.fuse_context(context_hidden_states.to(noise_embeds.dtype))  # [b, c, H]
        c_len = 0 if context is None else context.shape[1]
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past_len, past_len + c_len + q_len, device=noise_embeds.device)[None].expand(b, -1)
        if position_ids.shape[-1] != c_len + q_len:
            raise ValueError(f"position_ids covers {position_ids.shape[-1]} tokens, expected context {c_len} + block {q_len}")
        position_embeddings = self.rotary_emb(noise_embeds, position_ids)  # ([b, c+q, hd], [b, c+q, hd])

        mask_by_type = {}
        for layer_type in set(self.config.layer_types):
            if attention_mask is not None and attention_mask.dim() == 4:
                mask_by_type[layer_type] = attention_mask
                continue
            window = self.config.sliding_window if layer_type == "sliding_attention" else None
            if key_positions is not None:  # a preallocated cache: the caller says what each slot holds
                mask_by_type[layer_type] = block_attention_mask(position_ids[:, -q_len:], key_positions, attention_mask, window,
                                                                self.config.is_causal, fixed=True)
                continue
            kv_len = past_len + c_len + q_len
            # keys are every committed token then the block, contiguous up to the block's end
            slot_positions = position_ids[:, -1:] - kv_len + 1 + torch.arange(kv_len, device=position_ids.device)  # [b, kv]
            padding = attention_mask[:, -kv_len:] if attention_mask is not None else None
            mask_by_type[layer_type] = block_attention_mask(position_ids[:, -q_len:], slot_positions, padding, window,
                                                            self.config.is_causal)

        hidden_states = noise_embeds
        for layer_idx, layer in enumerate(self.layers):
            hidden_states = layer(
                hidden_states,
                context,
                position_embeddings,
                mask_by_type[self.config.layer_types[layer_idx]],
                past_key_values,
                block_size=block_size,
                **kwargs,
            )
        return DFlash2Output(last_hidden_state=self.norm(hidden_states), past_key_values=past_key_values)

    # ---- the target's embedding and head, applied on the draft side -------------------------------------------

    def embed_block(self, embed_tokens: nn.Module, block_ids: torch.LongTensor) -> torch.Tensor:
        """[b, q] ids -> [b, q, H]: the RAW rows of the TARGET's table, times ``input_embedding_scale``, on the
        block's device. Raw rows as the engines read them: a target whose embedding module scales its own output
        (Gemma's ``embed_scale``) states that factor as ``input_embedding_scale`` instead, so it is applied once."""
        with module_weights(embed_tokens):
            weight = embed_tokens.weight
            embeds = F.embedding(block_ids.to(weight.device), weight).to(block_ids.device)  # [b, q, H]
        if self.config.input_embedding_scale is not None:
            embeds = embeds * self.config.input_embedding_scale
        return embeds

    def draft_head(self, lm_head: nn.Module) -> nn.Module:
        """The head drafts go through: the target's, or its ``config.draft_vocab_ids`` rows (a DraftVocabHead)."""
        if self.config.draft_vocab_ids is None:
            return lm_head
        return DraftVocabHead(lm_head, self.config.draft_vocab_ids)

    def draft_logits(self, lm_head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """[b, n, H] drafter hidden -> [b, n, V] logits through the TARGET's head and logit transforms
        (``V`` = the sub-vocabulary's size when ``lm_head`` is a DraftVocabHead)."""
        device = hidden.device
        weight = lm_head.weight
        if isinstance(lm_head, (nn.Linear, DraftVocabHead)) and weight.device.type != "meta":
            # the target's plain head or its draft-vocabulary rows: the faster product, where the weights are
            logits = linear_head(hidden.to(weight.device, weight.dtype), weight, lm_head.bias)
        else:  # an offloaded head (its hook loads the weights), or a quantized / tensor-parallel one: its own forward
            logits = lm_head(hidden.to(weight.dtype))
        logits = logits.to(device)
        if self.config.output_multiplier is not None:
            logits = logits * self.config.output_multiplier
        if self.config.final_logit_softcapping is not None:
            cap = self.config.final_logit_softcapping
            logits = cap * torch.tanh(logits / cap)
        return logits


# save_pretrained copies these files (and their relative imports) next to the weights.
DFlash2Config.register_for_auto_class()
DFlash2DraftModel.register_for_auto_class("AutoModel")
install_assisted_generation_hook()

__all__ = [
    "DFlash2DraftModel",
    "DFlash2PreTrainedModel",
    "DraftVocabHead",
    "SelectorWalk",
]
