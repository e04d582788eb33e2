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
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import ModelOutput
from transformers.modeling_utils import PreTrainedModel

from .configuration_dflash2 import DFlash2Config
from .devices_dflash2 import execution_device, module_weights  # noqa: F401 (execution_device: part of this module's API)
from .layers_dflash2 import (DFlash2Attention, DFlash2DecoderLayer, DFlash2DynamicConv, DFlash2MLP,  # noqa: F401 (this module's API)
                             DFlash2RMSNorm, DFlash2RotaryEmbedding, block_attention_mask)
from .selector_dflash2 import DFlash2CandidateSelector, DraftVocabHead, SelectorWalk, linear_head  # noqa: F401 (this module's API)
from .suffix_dflash2 import SuffixIndex
from .generation_dflash2 import dflash2_generate, install_assisted_generation_hook  # noqa: F401 (custom_generate uses it)


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
        """The head drafts go through: the target's, or its ``config.draft_vocab_ids`` rows (a DraftVocabHead, copied
        once and reused while the head's weight and the id list stay the same: a copy costs ~18 ms per call on a CPU)."""
        ids = self.config.draft_vocab_ids
        if ids is None:
            return lm_head
        weight = lm_head.weight
        key = (len(ids), weight.device, weight.dtype, weight.data_ptr(), weight._version)
        cached = self.__dict__.get("_draft_head")  # (head ref, the id list, key, DraftVocabHead); not a submodule: never saved
        if cached is None or cached[0]() is not lm_head or cached[1] is not ids or cached[2] != key:
            cached = (weakref.ref(lm_head), ids, key, DraftVocabHead(lm_head, ids))
            self.__dict__["_draft_head"] = cached
        return cached[3]

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
