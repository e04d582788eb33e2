"""Tiny random targets of real transformers architectures and tiny DFlash 2 drafters (odd sizes), for the tests,
the rollback benchmark and the GPU check.

Dense: llama / qwen3 / qwen3_moe (``tiny_target``). Stateful hybrids: ``glm5_next`` is GLM-5.3-Flash's
architecture (KDA linear attention + MLA with a DSA indexer, MoE, hyper-connection streams, a vision
tower); ``qwen3_next`` is Gated DeltaNet + attention.
"""

from __future__ import annotations

import torch

from . import drafter as root

VOCAB = 131
HIDDEN = 48
# a GPU-like cost model for the hybrid rule: drafting and verifying cost nothing extra, so every drafted
# token is verified (tests/test_hybrid.py sets CPU-like costs to test the cut drafts and plain steps)
FREE_COSTS = {"multi_token_step": 0.0, "per_token": 0.0, "draft": 0.0}
CPU_FP32_COSTS = {"multi_token_step": 0.65, "per_token": 0.035, "draft": 0.25}


def tiny_target(arch: str = "llama", vocab: int = VOCAB, hidden: int = HIDDEN, layers: int = 7, seed: int = 0):
    """A tiny random causal LM of a real transformers architecture (fp32, eval mode)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=72,
        num_hidden_layers=layers,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        eos_token_id=vocab - 1,
        bos_token_id=0,
        pad_token_id=vocab - 1,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        cfg = AutoConfig.for_model("llama", **common)
    elif arch == "qwen3":
        cfg = AutoConfig.for_model("qwen3", head_dim=8, **common)
    elif arch == "qwen3_moe":
        cfg = AutoConfig.for_model("qwen3_moe", head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1, **common)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()
    # make the random target peaky so greedy text is not pure noise (and drafts can match)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def tiny_drafter_config(target=None, **overrides):
    C = root.config_class()
    tcfg = target.config.get_text_config() if target is not None else None
    kw = dict(
        vocab_size=tcfg.vocab_size if tcfg else VOCAB,
        hidden_size=tcfg.hidden_size if tcfg else HIDDEN,
        intermediate_size=56,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=8,
        num_target_layers=tcfg.num_hidden_layers if tcfg else 7,
        mask_token_id=(tcfg.vocab_size if tcfg else VOCAB) - 2,
        block_size=5,
        conv_kernel_size=2,
        conv_group_size=16,
        selector_rank=12,
        selector_top_k=7,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        # verify every drafted token (as on a GPU): the tests that pin drafts and acceptance see whole blocks
        hybrid_ngram={"costs": FREE_COSTS},
    )
    kw.update(overrides)
    return C(**kw)


def tiny_drafter(target=None, seed: int = 1, attn_implementation: str = "sdpa", randomize: bool = True, **overrides):
    M = root.model_class()
    torch.manual_seed(seed)
    model = M._from_config(tiny_drafter_config(target, **overrides), attn_implementation=attn_implementation).eval()
    if randomize:  # perturb the identity conv and zero selector so every code path is exercised
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "base_kernel" in name or "kernel_projection" in name or "hidden_projection" in name:
                    p.add_(0.1 * torch.randn_like(p))
    return model


GLM5_HYBRID_LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"]  # MLA/DSA: each release names it


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
