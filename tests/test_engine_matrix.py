"""Every kind of target through the one engine, at batch 1 and at batch 4 (one prompt is a batch of one).

Kinds: tiny llama / qwen3 / qwen3_moe; the stateful hybrids glm5_next (the seed's GLM-5.3-Flash in miniature) and
qwen3_next; a sliding-window target (every layer attends through a window shorter than the text); and a target on
``flash_attention_2`` (a stand-in registered under that name: padded keys skipped, a 4D mask refused). For each:

* greedy output equals the target's own (batched) greedy ``generate``: mixed prompt lengths, left-padded, an EOS that
  ends rows at different steps; dynamic and static caches and paths and trees wherever the target can take them (a
  stateful or sliding-window target: one path on a dynamic cache; ``test_deploy`` pins the refusals);
* sampling keeps every row's distribution: chi-square against the exact joint law of the next tokens, per row.
"""

from __future__ import annotations

import pytest
import torch
from conftest import FREE_COSTS, VOCAB, overfit_drafter, root, tiny_drafter, tiny_target
from test_sampling import N_NEW, V, _processors, chi_square_p_value, exact_joint

from dflash2_tools.tiny_targets import tiny_glm5_next, tiny_qwen3_next

KINDS = ["llama", "qwen3", "qwen3_moe", "glm5_next", "qwen3_next", "sliding", "flash"]
FULL_ATTENTION = {"llama", "qwen3", "qwen3_moe", "flash"}  # trees and static caches
WINDOW = 6  # the sliding-window target's window: shorter than every text below


def make_target(kind: str, vocab: int = VOCAB, seed: int = 0, head_scale: float | None = None):
    if kind in ("glm5_next", "qwen3_next"):
        factory = tiny_glm5_next if kind == "glm5_next" else tiny_qwen3_next
        return factory(seed=seed, vocab=vocab, **({} if head_scale is None else {"head_scale": head_scale}))
    if kind == "sliding":
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.for_model("qwen3", vocab_size=vocab, hidden_size=48, intermediate_size=72, num_hidden_layers=5,
                                      num_attention_heads=6, num_key_value_heads=2, head_dim=8, use_sliding_window=True,
                                      sliding_window=WINDOW, max_window_layers=0, pad_token_id=0, eos_token_id=None)
        torch.manual_seed(seed)
        target = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
        with torch.no_grad():
            target.get_output_embeddings().weight.mul_(8.0 if head_scale is None else head_scale)
        return target
    target = tiny_target("qwen3" if kind == "flash" else kind, vocab=vocab, seed=seed, **({"hidden": 48, "layers": 3} if vocab == V else {}))
    if head_scale is not None:  # tiny_target's head is scaled by 8: rescale it to ``head_scale``
        with torch.no_grad():
            target.get_output_embeddings().weight.mul_(head_scale / 8.0)
    if kind == "flash":
        target.config._attn_implementation_internal = "flash_attention_2"  # the stand-in (fixture) serves the name
    return target


def drafter_shape(target) -> dict:
    """Taps and reduction a drafter needs for this target (hyper-connection streams are averaged)."""
    text = target.config.get_text_config()
    layers = text.num_hidden_layers
    shape = {"target_layer_ids": [0, layers // 2, layers - 1]}
    if getattr(text, "hc_mult", 1) > 1:
        shape["target_hidden_reduction"] = "mean"
    if text.hidden_size % 16:
        shape["conv_group_size"] = 8
    return shape


_ACCEPTING: dict[str, tuple] = {}


def accepting(kind: str):
    """(target, a drafter trained on the target's greedy text, its prompts), built once per kind."""
    if kind not in _ACCEPTING:
        target = make_target(kind)
        drafter, prompts = overfit_drafter(target, steps=60, **drafter_shape(target))
        _ACCEPTING[kind] = target, drafter, prompts
    return _ACCEPTING[kind]


def left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])  # [b, width]
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(r) for r in rows])[:, None]).long()  # [b, width]
    return ids, mask


def mid_way_eos(free: torch.Tensor, width: int) -> int:
    """A token the rows first emit after a few steps: an EOS that ends rows mid-way (at different steps in a batch)."""
    early = set(free[:, width : width + 4].flatten().tolist())
    late = [t for t in free[:, width + 4 :].flatten().tolist() if t not in early]
    return max(set(late), key=late.count) if late else int(free[0, -1])


GREEDY_CASES = [(kind, batch, cache, mode) for kind in KINDS for batch in (1, 4)
                for cache in (("dynamic", "static") if kind in FULL_ATTENTION else ("dynamic",))
                for mode in (("path", "tree") if kind in FULL_ATTENTION else ("path",))]


@pytest.mark.parametrize("kind,batch,cache,mode", GREEDY_CASES, ids=["-".join(map(str, c)) for c in GREEDY_CASES])
def test_greedy_equals_the_targets_own_generate(kind, batch, cache, mode, flash_stand_in, monkeypatch):
    target, drafter, prompts = accepting(kind)
    monkeypatch.setattr(drafter.config, "hybrid_ngram", {**drafter.config.hybrid_settings(), "costs": FREE_COSTS})
    monkeypatch.setattr(drafter.config, "tree_budget", 6 if mode == "tree" else None)
    lengths = [7] if batch == 1 else [3, 9, 5, 7]
    ids, mask = left_padded([prompts[i % len(prompts)][:n] for i, n in enumerate(lengths)])
    width = ids.shape[1]
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    free = target.generate(**kw, eos_token_id=None)
    eos = mid_way_eos(free, width)
    want = target.generate(**kw, eos_token_id=eos)
    calls = len(flash_stand_in)
    with root.generation().collect_stats() as runs:
        got = target.generate(**kw, eos_token_id=eos, assistant_model=drafter,
                              **({"cache_implementation": "static"} if cache == "static" else {}))
    assert torch.equal(got, want)
    stats = runs[-1]
    assert stats.accepted > 0, stats.as_dict()  # drafts were verified and accepted: the commit paths ran
    assert stats.mode == ("tree-6" if mode == "tree" else "linear")
    if batch > 1:  # the EOS ended rows at different steps
        ends = [int(((row[width:] == eos).nonzero().flatten().tolist() or [-1])[0]) for row in want]
        assert len(set(ends)) > 1, ends
    if kind == "flash":
        assert len(flash_stand_in) > calls  # the target's own kernel served its causal work (the prefill at least)
    if kind in ("glm5_next", "qwen3_next"):
        assert stats.rollback_seconds > 0  # linear-attention states rolled back and replayed


# ---- sampling ------------------------------------------------------------------------------------------------------

SAMPLES = 600
PROMPTS = {1: [[1, 3, 2]], 4: [[1, 3, 2], [4, 1], [2], [3, 0, 1]]}


def sampling_setup(kind: str):
    target = make_target(kind, vocab=V, seed=5, head_scale=2.8)  # flat enough that many cells have mass, not uniform
    target.generation_config.eos_token_id = None
    drafter = tiny_drafter(target, seed=7, mask_token_id=V - 1, selector_top_k=3, block_size=4,
                           **{"conv_group_size": 16, **drafter_shape(target)})
    with torch.no_grad():  # a proposal far from the target: q != p, so a verifier that ignores q fails (test_sampling)
        drafter.candidate_selector.hidden_projection.weight.normal_(0, 2.0)
    return target, drafter


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_sampling_keeps_each_rows_distribution(kind, batch, flash_stand_in, monkeypatch):
    target, drafter = sampling_setup(kind)
    monkeypatch.setattr(drafter.config, "hybrid_ngram", {**drafter.config.hybrid_settings(), "costs": FREE_COSTS})
    runs = assert_rows_keep_their_distribution(target, drafter, PROMPTS[batch], SAMPLES)
    assert sum(r.drafted for r in runs) > 0


def assert_rows_keep_their_distribution(target, drafter, prompts: list[list[int]], samples: int) -> list:
    """Sample the batch ``samples`` times through the drafter; each row's next ``N_NEW`` tokens against the exact joint
    law (chi-square). Returns the calls' statistics."""
    ids, mask = left_padded(prompts)
    counts = [{} for _ in prompts]
    with root.generation().collect_stats() as runs:
        for seed in range(samples):
            torch.manual_seed(seed)
            out = target.generate(input_ids=ids, attention_mask=mask, assistant_model=drafter, do_sample=True, max_new_tokens=N_NEW,
                                  temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0)
            for row, row_counts in enumerate(counts):
                cell = tuple(out[row, ids.shape[1] :].tolist())
                row_counts[cell] = row_counts.get(cell, 0) + 1
    for prompt, row_counts in zip(prompts, counts):
        expected = exact_joint(target, torch.tensor([prompt]), _processors(1.0, 1.0, 1.0))
        assert sum(p * samples >= 5 for p in expected.values()) >= 10  # cells enough for the test to have power
        assert chi_square_p_value(row_counts, expected, samples) > 1e-3, prompt
    return runs
