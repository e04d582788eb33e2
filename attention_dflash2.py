"""The attention the target runs under an explicit verification mask (tree and static-cache verification).

transformers' SDPA path copies every cached key and value once per layer per forward when the model shares
key/value heads (GQA) and a mask is given with more than one query (``repeat_kv``: the kernels that take
``enable_gqa`` do not take a mask on every device). A verification forward is exactly that case, so its cost
grew with the context (measured: ``python -m dflash2_tools.tree_step_cost``). ``packed_gqa_sdpa`` instead
folds the query heads that share a key/value head into the query dimension:

    query [b, H, q, d] -> [b, Hkv, (H/Hkv) * q, d]      mask [b, 1, q, k] -> [b, 1, (H/Hkv) * q, k]

and runs SDPA over the key/value heads as they are: the same numbers, with copies of the queries and the mask
(q rows) instead of the cache (k rows). It is registered with transformers' attention and mask interfaces under
``PACKED_SDPA``; everything else goes to transformers' own SDPA function. ``verification_attention`` switches a
target to it for one forward (tree and static-cache verification, a batch's verification over its holes).
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED_SDPA = "dflash2_packed_sdpa"


def packed_gqa_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' attention-function interface: (output [b, q, H, d], None)."""
    groups = getattr(module, "num_key_value_groups", 1)
    b, heads, q, d = query.shape
    if groups == 1 or q == 1 or attention_mask is None or attention_mask.shape[1] != 1 or kwargs.get("softcap") is not None \
            or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    k = key.shape[-2]
    packed = query.reshape(b, heads // groups, groups * q, d)  # [b, Hkv, G*q, d]: heads h = kv * G + g, as repeat_kv
    mask = attention_mask[..., :k]  # [b, 1, q, k]
    mask = mask[:, :, None].expand(b, 1, groups, q, k).reshape(b, 1, groups * q, k)  # [b, 1, G*q, k]
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scaling,
                                                           dropout_p=dropout)  # [b, Hkv, G*q, d]
    out = out.reshape(b, heads, q, d).transpose(1, 2).contiguous()  # [b, q, H, d]
    return out, None


AttentionInterface.register(PACKED_SDPA, packed_gqa_sdpa)
AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)


@contextlib.contextmanager
def verification_attention(target):
    """Run the target's attention through SDPA with packed GQA heads (``attention_dflash2``) for a forward under an
    explicit verification mask: flash-attention 2/3 and their hub-kernel variants take no 4D mask, and
    transformers' SDPA copies the whole cache per layer for a masked multi-query forward of a GQA model. Same
    cache layout, so prefill and plain steps keep their kernel; only the verification forward switches."""
    config = target.config.get_text_config()
    current = config._attn_implementation
    if current is None or not (current == "sdpa" or "flash" in current):
        yield
        return
    config._attn_implementation_internal = PACKED_SDPA
    try:
        yield
    finally:
        config._attn_implementation_internal = current


__all__ = ["PACKED_SDPA", "packed_gqa_sdpa", "verification_attention"]
