"""Shared fixtures: tiny random targets of several architectures and tiny DFlash 2 drafters (odd sizes)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DFLASH2_COST_CACHE", "")  # tests measure step costs in-process; nothing kept on disk between runs
# drafters shared between tests would learn each other's outputs: the suffix index is off unless a test sets one
# (tests/test_suffix.py)
os.environ.setdefault("DFLASH2_SUFFIX_INDEX", "0")

import pytest
import torch

torch.set_num_threads(1)  # tiny models: one thread is faster than two (no sync overhead)

from dflash2_tools import drafter as root

from dflash2_tools.tiny_targets import (  # noqa: F401  (re-exported: the tests import them from here)
    CPU_FP32_COSTS,
    FREE_COSTS,
    HIDDEN,
    VOCAB,
    tiny_drafter,
    tiny_drafter_config,
    tiny_target,
)


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


def tiny_target_folder(tmp_path):
    """A tiny target saved with a word-level tokenizer, usable as --target by the CLI."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from dflash2_tools.regenerate import save_chunk

    target = tiny_target("llama")
    folder = tmp_path / "target"
    target.save_pretrained(folder)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0")), pad_token="t0")
    tok.save_pretrained(folder)
    data = tmp_path / "data"
    data.mkdir()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB - 2, (int(n),), generator=g).tolist() for n in torch.randint(2, 9, (12,), generator=g)]
    seqs = greedy_sequences(target, prompts, max_new_tokens=24)
    save_chunk(data / "chunk_00000.npz", [s[:p] for s, p in seqs], [s[p:] for s, p in seqs])
    return folder, data


@pytest.fixture(scope="session")
def llama_target():
    return tiny_target("llama")


@pytest.fixture(scope="session")
def accepting(llama_target):
    """(target, drafter, training prompts) where the drafter accepts many tokens."""
    drafter, prompts = overfit_drafter(llama_target)
    return llama_target, drafter, prompts


@pytest.fixture
def flash_stand_in():
    """A stand-in registered under flash_attention_2 for the test: like the real kernel, causal (bottom-right) with
    padded keys skipped (the 2D mask transformers hands a flash kernel: its varlen path), and it cannot take an
    arbitrary mask -- it fails loudly when handed a 4D one. Returns the call log (query lengths)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    calls = []

    def stand_in(module, query, key, value, attention_mask, scaling=None, dropout=0.0, is_causal=None, **kwargs):
        if attention_mask is not None and attention_mask.dim() == 4:
            raise AssertionError("a 4D mask reached the flash kernel")
        calls.append(query.shape[2])
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        if attention_mask is not None and attention_mask.shape[-1] < key.shape[2]:  # a static cache: its filled slots
            key, value = key[:, :, : attention_mask.shape[-1]], value[:, :, : attention_mask.shape[-1]]
        q, k = query.shape[2], key.shape[2]
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
        allowed = torch.ones(1, 1, q, k, dtype=torch.bool)
        if causal and q > 1:
            allowed = allowed.tril(k - q)  # query i sees keys <= k - q + i
        if attention_mask is not None:  # [b, k] 1 = a real key
            allowed = allowed & attention_mask.bool()[:, None, None, -k:]
        empty = ~allowed.any(-1, keepdim=True)  # a padding query: the kernel skips it (zeros)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed | empty, scale=scaling)
        return out.masked_fill(empty, 0.0).transpose(1, 2).contiguous(), None

    mapping = ALL_ATTENTION_FUNCTIONS._global_mapping
    saved = mapping.get("flash_attention_2")
    mapping["flash_attention_2"] = stand_in
    yield calls
    if saved is None:
        del mapping["flash_attention_2"]
    else:
        mapping["flash_attention_2"] = saved


def pretend_transformers_version(monkeypatch, version: str) -> None:
    """Make every loaded copy of the version guard see transformers ``version``. The guard reads the ``transformers``
    module its package imported, which is not always the object a test module imported (another test may have
    re-imported transformers), so patch each one."""
    import sys

    import transformers

    modules = {id(transformers): transformers, id(sys.modules["transformers"]): sys.modules["transformers"]}
    for name, module in list(sys.modules.items()):
        if name.endswith(".checks_dflash2") and hasattr(module, "transformers"):
            modules[id(module.transformers)] = module.transformers
    for module in modules.values():
        monkeypatch.setattr(module, "__version__", version)
