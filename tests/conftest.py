"""Shared fixtures: tiny random targets of several architectures and tiny DFlash 2 drafters (odd sizes)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

torch.set_num_threads(1)  # tiny models: one thread is faster than two (no sync overhead)

from dflash2_tools import drafter as root

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


@pytest.fixture(scope="session")
def gen_module():
    return root.generation()


@pytest.fixture(scope="session")
def modeling_module():
    return root.modeling()


def greedy_sequences(target, prompts, max_new_tokens=60):
    """The target's own greedy continuations: (tokens, prompt_length) pairs, as regenerate.py stores them."""
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        full = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append((full[0].tolist(), len(p)))
    return out


def overfit_drafter(target, steps=120, seed=0, **overrides):
    """A drafter that accepts many tokens: trained (with the real training code) on the target's greedy text."""
    from types import SimpleNamespace

    from dflash2_tools.training import batches, features, forward

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, target.config.get_text_config().vocab_size - 2, (n,), generator=g).tolist() for n in (3, 7, 12, 5)]
    seqs = greedy_sequences(target, prompts)
    drafter = tiny_drafter(target, randomize=False, **overrides).train()
    args = SimpleNamespace(blocks_per_seq=12, gamma=None, selector_weight=1.0, position_weighting="decay", chain_floor=0.1, distill_weight=0.0)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    tokens, lengths, prompt_lengths = batches.collate(seqs, pad_id=0)
    head = forward.LossHead.of(drafter, target)
    for step in range(steps):
        feats, _, _ = features.target_forward(target, tokens, lengths, drafter.config.target_layer_ids, drafter.config.target_hidden_reduction)
        loss, _ = forward.compute_loss(drafter, target, head, (tokens, lengths, prompt_lengths), feats, torch.Generator().manual_seed(step), args)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return drafter.eval(), prompts


@pytest.fixture(scope="session")
def llama_target():
    return tiny_target("llama")


@pytest.fixture(scope="session")
def accepting(llama_target):
    """(target, drafter, training prompts) where the drafter accepts many tokens."""
    drafter, prompts = overfit_drafter(llama_target)
    return llama_target, drafter, prompts
