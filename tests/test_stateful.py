"""Stateful hybrid targets (linear attention + attention): glm5_next (GLM-5.3-Flash) and qwen3_next.

transformers 5.23 refuses assisted generation for them; DFlash 2 rolls their recurrent
state back by replay (rollback_dflash2.py). These tests pin: exact state after rollback,
greedy output equal to the target's own generate, the sampling distribution, and training.
"""

from __future__ import annotations

import pytest
import torch
from conftest import FREE_COSTS, overfit_drafter, tiny_drafter

from dflash2_tools import drafter as root
from dflash2_tools.tiny_targets import tiny_glm5_next, tiny_qwen3_next

VOCAB = 103


def drafter_for(target, **kw):
    layers = target.config.get_text_config().num_hidden_layers
    reduction = "mean" if getattr(target.config.get_text_config(), "hc_mult", 1) > 1 else None
    kw = {"conv_group_size": 8, **kw}  # hidden 40
    return tiny_drafter(target, target_layer_ids=[0, layers // 2, layers - 1], target_hidden_reduction=reduction, **kw)


@pytest.fixture(scope="module", params=["glm5_next", "qwen3_next"])
def stateful(request):
    target = tiny_glm5_next() if request.param == "glm5_next" else tiny_qwen3_next()
    random_drafter = drafter_for(target)
    accepting, prompts = overfit_drafter(target, steps=80, target_layer_ids=random_drafter.config.target_layer_ids,
                                         target_hidden_reduction=random_drafter.config.target_hidden_reduction, conv_group_size=8)
    return request.param, target, random_drafter, accepting, prompts


def _state(cache, idx):
    layer = cache.layers[idx]
    if hasattr(layer, "recurrent_states"):
        return [layer.conv_states[0][..., -layer.conv_kernel_size[0]:], layer.recurrent_states[0]]
    out = [layer.keys, layer.values]
    if getattr(layer, "indexer_keys", None) is not None:
        out.append(layer.indexer_keys)
    return out


@pytest.mark.parametrize("fed,accepted", [(5, 1), (5, 3), (4, 4), (6, 2)])
def test_rollback_state_equals_a_target_that_saw_only_accepted_tokens(stateful, fed, accepted):
    name, target, *_ = stateful
    if name == "glm5_next":  # a sparse DSA indexer (2 pools of 4 + tail), so indexer caches matter
        target = tiny_glm5_next(index_topk=8)
    rollback_mod = root._sibling("rollback_dflash2")
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(fed * 10 + accepted)
    prefix = torch.randint(1, VOCAB, (1, 11), generator=g)
    block = torch.randint(1, VOCAB, (1, fed), generator=g)

    def fresh():
        cache = DynamicCache(config=target.config)
        target(prefix, past_key_values=cache, use_cache=True)
        return cache

    with torch.no_grad():
        reference = fresh()
        target(block[:, :accepted], past_key_values=reference, use_cache=True)

        cache = fresh()
        cache.activate_past_recording()
        owner = type("Owner", (), {})()
        rb = rollback_mod.LinearStateRollback(target, owner)
        assert rb.mixers, "no linear-attention mixers found"
        rb.begin_step(cache)
        target(block, past_key_values=cache, use_cache=True)
        cache.crop(-(fed - accepted))  # what transformers' assisted loop does
        rb.finish_step(accepted=accepted, fed=fed)

    assert cache.get_seq_length() == reference.get_seq_length() == 11 + accepted
    for idx in range(len(cache.layers)):
        for got, want in zip(_state(cache, idx), _state(reference, idx), strict=True):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=f"layer {idx} state differs after rollback")
    del owner  # hooks go with their owner
    assert all(not m._forward_pre_hooks for m in rb.mixers.values())


def test_rollback_would_be_needed(stateful):
    """Guard against a vacuous test: without replay, the recurrent state keeps the rejected tokens."""
    _, target, *_ = stateful
    from transformers import DynamicCache

    ids = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = DynamicCache(config=target.config), DynamicCache(config=target.config)
        for c in (a, b):
            c.activate_past_recording()
        target(ids[:, :6], past_key_values=a, use_cache=True)
        target(ids, past_key_values=b, use_cache=True)
        b.crop(-3)
    idx = next(i for i, layer in enumerate(a.layers) if hasattr(layer, "recurrent_states"))
    assert not torch.allclose(a.layers[idx].recurrent_states[0], b.layers[idx].recurrent_states[0], atol=1e-4)


def test_plain_transformers_refuses_stateful_assisted_generation(stateful):
    """The refusal we lift is real (and stays for non-DFlash-2 assistants)."""
    _, target, drafter, *_ = stateful
    ids = torch.randint(1, VOCAB, (1, 6))
    with pytest.raises(ValueError, match="stateful"):
        target.generate(ids, assistant_model=target, max_new_tokens=4, do_sample=False)


@pytest.mark.parametrize("which", ["random", "accepting"])
def test_greedy_equals_target_generate(stateful, which):
    name, target, random_drafter, accepting, train_prompts = stateful
    gen = root.generation()
    drafter = random_drafter if which == "random" else accepting
    g = torch.Generator().manual_seed(7)
    prompts = [torch.tensor([p]) for p in train_prompts] if which == "accepting" else []
    prompts += [torch.randint(1, VOCAB, (1, n), generator=g) for n in (1, 4, 13)]
    total = None
    for i, ids in enumerate(prompts):
        n_new = (9, 24, 40)[i % 3]
        want = target.generate(ids, max_new_tokens=n_new, do_sample=False)
        got, stats = gen.dflash2_generate(target, drafter, ids, max_new_tokens=n_new, do_sample=False)
        assert torch.equal(got, want), f"{name}/{which}: prompt {i} diverged"
        total = stats if total is None else total.merge(stats)
    if which == "accepting":  # the rollback was exercised with long partial acceptances
        assert total.mean_acceptance_length > 1.5, total.as_dict()
        assert any(1 < n < drafter.config.block_size for n in total.accept_lengths)
    assert total.rollback_seconds > 0


def test_greedy_with_ngram_steps_equals_target_generate(stateful, monkeypatch):
    """Hybrid n-gram steps propose more tokens than a block (prompt_lookup_num_tokens=9): the rollback
    replays whatever was verified, so the state stays exact (the recorded accepted counts drive it)."""
    name, target, random_drafter, *_ = stateful
    monkeypatch.setattr(random_drafter.config, "hybrid_ngram", {"ngram_margin": 100.0, "costs": FREE_COSTS})  # the n-gram wins every match
    gen = root.generation()
    g = torch.Generator().manual_seed(11)
    used = []
    for n in (3, 6):
        ids = target.generate(torch.randint(1, VOCAB, (1, n), generator=g), max_new_tokens=30, do_sample=False)  # loops
        want = target.generate(ids, max_new_tokens=25, do_sample=False)
        got, stats = gen.dflash2_generate(target, random_drafter, ids, max_new_tokens=25, do_sample=False, prompt_lookup_num_tokens=9)
        assert torch.equal(got, want), f"{name}: diverged with n-gram steps"
        used += [length for length, p in zip(stats.accept_lengths, stats.proposers) if p == "ngram"]
    assert used and max(used) > 1 and stats.rollback_seconds > 0


@pytest.mark.parametrize("arch", ["glm5_next", "qwen3_next"])
def test_sampling_matches_target_distribution(arch):
    """The attention-only targets' chi-square test (test_sampling.py), on a 5-token-vocab stateful target."""
    from test_sampling import SAMPLES, V, _processors, _sample_counts, chi_square_p_value, exact_joint

    target = (tiny_glm5_next if arch == "glm5_next" else tiny_qwen3_next)(seed=5, vocab=V, head_scale=0.35)
    target.generation_config.eos_token_id = None
    drafter = drafter_for(target, seed=7, mask_token_id=V - 1, selector_top_k=3, block_size=4)
    with torch.no_grad():  # a proposal far from the target: q != p, so rejections (and rollbacks) are common
        drafter.candidate_selector.hidden_projection.weight.normal_(0, 2.0)
    prompt = torch.tensor([[1, 3, 2]])
    gen_kw = dict(temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0)
    expected = exact_joint(target, prompt, _processors(1.0, 1.0, 1.0))
    assert abs(sum(expected.values()) - 1) < 1e-4
    with root.generation().collect_stats() as runs:
        counts = _sample_counts(target, drafter, prompt, gen_kw, SAMPLES)
    assert sum(r.drafted for r in runs) > 0 and sum(r.rollback_seconds for r in runs) > 0
    assert chi_square_p_value(counts, expected, SAMPLES) > 1e-3


def test_train_step_on_hyperconnection_target():
    from types import SimpleNamespace

    from dflash2_tools.training import batches, features, forward, model

    target = tiny_glm5_next()
    args = SimpleNamespace(layers=2, num_context_layers=3, target_layer_ids=None, intermediate_size=48, heads=4, kv_heads=2,
                           sliding_window=None, block_size=4, mask_token_id=VOCAB - 2, no_conv=False, conv_group_size=8,
                           no_selector=False, selector_rank=8, selector_top_k=5, target_name="tiny-glm5_next",
                           blocks_per_seq=6, gamma=None, selector_weight=1.0, position_weighting="chain", chain_floor=0.1,
                           distill_weight=1.0)
    cfg = model.build_drafter_config(target, args)
    assert cfg.target_hidden_reduction == "mean" and cfg.target_model_type == "glm5_next"
    cfg.draft_vocab_ids = list(range(1, VOCAB, 3))
    drafter = root.model_class()._from_config(cfg).train()
    head = forward.LossHead.of(drafter, target)
    seqs = [(torch.randint(1, VOCAB, (n,)).tolist(), 3) for n in (14, 20)]
    tokens, lengths, prompt_lengths = batches.collate(seqs, pad_id=0)
    feats, logp, cols = features.target_forward(target, tokens, lengths, cfg.target_layer_ids, cfg.target_hidden_reduction,
                                                head.module, 4, drafter.draft_logits)
    assert feats.shape == (2, 20, 3 * 40)  # streams reduced: [b, T, n_layers * H]
    assert logp.shape == cols.shape == (2, 20, 4) and int(cols.max()) < len(cfg.draft_vocab_ids)  # teacher over draft columns
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    losses = []
    for step in range(4):
        loss, metrics = forward.compute_loss(drafter, target, head, (tokens, lengths, prompt_lengths), feats,
                                             torch.Generator().manual_seed(0), args, (logp, cols))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert "distill" in metrics and losses[-1] < losses[0]


@pytest.mark.parametrize("index_topk,consistent", [(64, True), (8, False)])
def test_dsa_target_multi_token_vs_incremental(index_topk, consistent):
    """The README caveat, pinned: a sparse DSA indexer breaks exact pool ties (repeated tokens, NoPE keys)
    differently in one multi-token forward than in one-token decoding; with every pool selected it cannot."""
    from transformers import DynamicCache

    target = tiny_glm5_next(index_topk=index_topk)
    prompt = torch.randint(1, VOCAB, (1, 13), generator=torch.Generator().manual_seed(7))[:, 1:5]  # the prompt that repeats
    seq = tiny_glm5_next().generate(prompt, max_new_tokens=40, do_sample=False)  # "... 35 79 35 79 ..."
    with torch.no_grad():
        full = target(seq).logits[0, 3:-1]
        cache = DynamicCache(config=target.config)
        steps = [target(seq[:, :4], past_key_values=cache, use_cache=True).logits[0, -1]]
        steps += [target(seq[:, i : i + 1], past_key_values=cache, use_cache=True).logits[0, -1] for i in range(4, seq.shape[1] - 1)]
    diff = (full - torch.stack(steps)).abs().max().item()
    assert (diff < 1e-4) == consistent, diff


@pytest.mark.parametrize("prompt_length", [1, 2, 3, 4])
def test_short_prompts_with_plain_steps_glm5_next(prompt_length):
    """Prompts shorter than the linear-attention conv kernel (4), with CPU-like costs: the hybrid rule takes
    plain one-token steps, whose decode kernel needs the full conv window (it crashed before the fix)."""
    target = tiny_glm5_next()
    drafter = drafter_for(target, hybrid_ngram={"costs": {"multi_token_step": 0.65, "per_token": 0.035, "draft": 0.25}})
    gen = root.generation()
    plain_steps = 0
    for token in (3, 40):
        ids = torch.full((1, prompt_length), token)
        want = target.generate(ids, max_new_tokens=20, do_sample=False)
        got, stats = gen.dflash2_generate(target, drafter, ids, max_new_tokens=20, do_sample=False)
        assert torch.equal(got, want)
        plain_steps += stats.per_proposer.get("none", {}).get("steps", 0)
    assert plain_steps > 0  # the path that crashed ran
