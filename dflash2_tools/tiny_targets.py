"""Tiny random stateful hybrid targets of real transformers architectures (tests and the rollback benchmark).

``glm5_next`` is GLM-5.3-Flash's architecture (KDA linear attention + MLA with a DSA indexer,
MoE, hyper-connection streams, a vision tower); ``qwen3_next`` is Gated DeltaNet + attention.
"""

from __future__ import annotations

import torch

GLM5_HYBRID_LAYERS = ["linear_attention", "linear_attention", "indexed_attention", "linear_attention", "indexed_attention"]


def tiny_glm5_next(seed: int = 0, vocab: int = 103, head_scale: float = 8.0, layer_types: list[str] | None = None, hidden: int = 40,
                   index_topk: int = 64):
    """GLM-5.3-Flash in miniature: 3 KDA + 2 MLA/DSA layers, 4 experts, 3 hyper-connection streams, 1-block vision tower.

    ``index_topk=64`` keeps every pool selected at test lengths; a smaller value (e.g. 8, two pools
    of 4) makes the DSA indexer sparse -- and then the target's own multi-token forward can pick
    other pools than its one-token decode at near-tied scores (see the README), so tests that
    compare with ``target.generate`` use the default.
    """
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    layer_types = layer_types or GLM5_HYBRID_LAYERS
    text = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=56, moe_intermediate_size=16, num_hidden_layers=len(layer_types),
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, v_head_dim=8,
        index_topk=index_topk, index_head_dim=8, index_n_heads=8, index_kpool=4,  # 8 heads: few ReLU-zero ties
        linear_head_dim=8, linear_num_heads=2, hc_mult=3, hc_sinkhorn_iters=4, layer_types=layer_types,
        mlp_layer_types=["dense"] + ["sparse"] * (len(layer_types) - 1), pad_token_id=0, eos_token_id=None,
    )
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=hidden,
                  projection_intermediate_size=16, patch_size=2, spatial_merge_size=1, temporal_patch_size=1)
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text, vision_config=vision)).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(head_scale)  # peaky, so greedy text has structure
    return model


def tiny_qwen3_next(seed: int = 0, vocab: int = 103, head_scale: float = 8.0):
    """Qwen3-Next in miniature: 3 Gated DeltaNet layers + 1 attention layer, 4 experts."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        vocab_size=vocab, hidden_size=40, intermediate_size=56, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=10, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, pad_token_id=0, eos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(head_scale)
    return model
