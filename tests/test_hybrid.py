"""Hybrid drafting: the n-gram (prompt-lookup) proposer beside the block draft stays lossless.

``FORCED`` makes the rule verify the n-gram continuation whenever one exists, so every test
below really runs n-gram steps (asserted through ``DFlash2Stats.proposers``).
"""

from __future__ import annotations

import pytest
import torch
from conftest import CPU_FP32_COSTS, FREE_COSTS, VOCAB, root, tiny_drafter, tiny_target

FORCED = {"ngram_margin": 100.0, "costs": FREE_COSTS}  # the n-gram wins every step that has a match


@pytest.fixture()
def forced(monkeypatch):
    def force(drafter):
        monkeypatch.setattr(drafter.config, "hybrid_ngram", dict(FORCED))
        return drafter

    return force


def looping_prompt(target, n_prompt=6, n_loop=40, seed=3):
    """A prompt that ends in the target's own greedy text: tiny random targets fall into cycles,
    so the prompt already holds the loop the target is about to repeat (n-gram matches at once)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB - 2, (1, n_prompt), generator=g)
    return target.generate(ids, do_sample=False, max_new_tokens=n_loop, eos_token_id=None, pad_token_id=0)


def _generate(gen_module, target, drafter, ids, prompt_lookup_num_tokens=None, max_matching_ngram_size=None, **kw):
    """The speculative call (with the hybrid's knobs) equals the target's own greedy call (without them)."""
    ref = target.generate(ids, do_sample=False, pad_token_id=0, **kw)
    knobs = {"prompt_lookup_num_tokens": prompt_lookup_num_tokens, "max_matching_ngram_size": max_matching_ngram_size}
    kw.update({k: v for k, v in knobs.items() if v is not None})
    out, stats = gen_module.dflash2_generate(target, drafter, ids, do_sample=False, pad_token_id=0, **kw)
    assert torch.equal(ref, out), (ref.tolist(), out.tolist())
    return out, stats


# ---- the index --------------------------------------------------------------------------------------------------


def test_ngram_index_finds_the_latest_longest_match():
    ngram = root._sibling("ngram_dflash2")
    index = ngram.NgramIndex(min_n=1, max_n=3)
    index.extend([5, 6, 7, 8, 5, 6, 9, 5, 6])
    match = index.lookup(4)  # suffix (9, 5, 6) never seen before; (5, 6) last seen at 4..5, followed by 9, 5, 6
    assert (match.match_length, match.tokens) == (2, [9, 5, 6, 9])  # past the context's end: the period repeats
    index.extend([7])  # (5, 6, 7) seen at 0..2, followed by 8, 5, 6, 9
    assert (index.lookup(3).match_length, index.lookup(3).tokens) == (3, [8, 5, 6])
    index.extend([7, 7])
    assert index.lookup(4).tokens == [7, 7, 7, 7]  # a run: (7, 7) last seen one token back
    assert ngram.NgramIndex(1, 2).lookup(3) is None  # empty context
    with pytest.raises(ValueError, match="min_n"):
        ngram.NgramIndex(3, 2)


def test_ngram_index_is_incremental_and_equals_a_full_scan():
    ngram = root._sibling("ngram_dflash2")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4, (300,), generator=g).tolist()
    index = ngram.NgramIndex(1, 3)
    for end in range(1, len(ids)):
        index.extend(ids[len(index.ids) : end])
        got = index.lookup(5)
        want = None  # brute force: longest n, latest earlier occurrence
        for n in range(min(3, end), 0, -1):
            starts = [s for s in range(end - n) if ids[s : s + n] == ids[end - n : end]]
            if starts:
                period = end - (starts[-1] + n)  # a continuation reaching the context's end repeats its period
                want = (n, [ids[starts[-1] + n + i % period] for i in range(5)])
                break
        assert (None if got is None else (got.match_length, got.tokens)) == want


def rule(ngram, costs=None, drafter_acceptance=(0.4, 0.2)):
    return ngram.HybridRule([0.0, 0.3, 0.9], drafter_scale=1.0, ngram_margin=0.0, drafter_acceptance=list(drafter_acceptance),
                            costs=ngram.StepCosts(**(costs or FREE_COSTS)))


def test_rule_prefers_the_higher_expected_accepted_length():
    ngram = root._sibling("ngram_dflash2")
    free = rule(ngram)  # no costs: verify everything
    long_match = ngram.NgramMatch([1, 2, 3, 4], 2)
    short_match = ngram.NgramMatch([1, 2, 3, 4], 1)
    assert free.choose(long_match, [0.2, 0.1, 0.1]) == ngram.Proposal("ngram", 4)  # 0.9+0.81+... > 0.2+0.02+...
    assert free.choose(short_match, [0.9, 0.9, 0.9]) == ngram.Proposal("dflash2", 3)
    assert free.choose(None, [0.1]) == free.choose(ngram.NgramMatch([], 2), [0.1]) == ngram.Proposal("dflash2", 1)
    assert free.choose(None, None) == ngram.Proposal("none", 0)


def test_rule_cuts_drafts_to_what_pays_for_its_verification():
    ngram = root._sibling("ngram_dflash2")
    cpu = rule(ngram, {"multi_token_step": 0.5, "per_token": 0.1, "draft": 0.25})
    # (1 + E_L) / (1.5 + 0.1 L): 0.9, 0.8, 0.05 -> L=1: 1.18, L=2: 1.59, L=3: 1.48: verify two
    assert cpu.choose(None, [0.9, 0.8 / 0.9, 0.05 / 0.8]) == ngram.Proposal("dflash2", 2)
    assert cpu.choose(None, [0.3, 0.9]) == ngram.Proposal("none", 0)  # nothing pays for a multi-token forward
    match = ngram.NgramMatch([1, 2, 3, 4], 2)  # 0.9 per token: (1 + 3.10) / 1.9 = 2.16
    assert cpu.choose(match, [0.9, 0.8 / 0.9, 0.05 / 0.8]) == ngram.Proposal("ngram", 4)
    # before drafting: a mean draft (0.4, 0.2 -> (1.6) / (1.5 + 0.2 + 0.25) < 1) is not worth its forward;
    # on a GPU (no costs) it is, unless the n-gram promises more
    pays = lambda r, m: ngram.draft_pays([r], [m], [2], r.costs)  # noqa: E731
    assert not pays(cpu, None) and pays(rule(ngram), None) and not pays(rule(ngram), match)


def test_a_tree_step_verifies_the_copies_alone_only_when_they_promise_more():
    """``copy_beats_tree``: a long, likely copy beats a mediocre tree on a CPU (the drafter's forward and the tree's
    width are saved); a mediocre copy beside a good tree does not; one row without a copy keeps a batch on trees;
    where verification is free, a copy as likely as the tree still wins (the drafter's forward is not free) and a
    better tree wins."""
    ngram = root._sibling("ngram_dflash2")
    cpu = ngram.StepCosts(multi_token_step=0.65, per_token=0.035, draft=0.25)
    gpu = ngram.StepCosts(multi_token_step=0.0, per_token=0.0, draft=0.1)
    rule = ngram.HybridRule([0.0, 0.5, 0.7, 0.9], 1.0, 0.0, [0.8] * 7, cpu)
    likely = ngram.NgramMatch(list(range(8)), 4, "suffix", [0.97] * 8)  # 1 + 6.9 tokens expected
    unsure = ngram.NgramMatch(list(range(8)), 2, "suffix", [0.4] * 8)  # 1 + 0.67
    assert ngram.copy_beats_tree([rule], [likely], [3.0], 8, cpu) == 8
    assert ngram.copy_beats_tree([rule], [unsure], [3.0], 8, cpu) == 0
    assert ngram.copy_beats_tree([rule, rule], [likely, None], [3.0, 3.0], 8, cpu) == 0
    assert ngram.copy_beats_tree([rule, rule], [likely, likely], [3.0, 3.0], 8, cpu) == 8
    assert ngram.copy_beats_tree([rule], [likely], [7.9], 8, gpu) == 8 and ngram.copy_beats_tree([rule], [likely], [9.5], 8, gpu) == 0
    assert ngram.copy_beats_tree([rule], [None], [3.0], 8, cpu) == 0


def test_a_tree_carries_as_much_of_the_copies_as_pays():
    """``tree_branch_length``: a likely copy rides along in full, an unsure one that the tree beats anyway is left out
    (its width is paid by every row) unless verification is free; in a batch a row without a copy still gets its tree, so another row's likely copy
    is carried (valued over the batch's rows, not by the row that gains least)."""
    ngram = root._sibling("ngram_dflash2")
    cpu = ngram.StepCosts(multi_token_step=0.65, per_token=0.035, draft=0.25)
    rule = ngram.HybridRule([0.0, 0.5, 0.7, 0.9], 1.0, 0.0, [0.8] * 7, cpu)
    likely = ngram.NgramMatch(list(range(8)), 4, "suffix", [0.97] * 8)
    unsure = ngram.NgramMatch(list(range(8)), 2, "suffix", [0.4] * 8)
    assert ngram.tree_branch_length([rule], [likely], [3.0], 4, cpu) == 8
    assert ngram.tree_branch_length([rule], [unsure], [3.0], 4, cpu) == 0
    assert ngram.tree_branch_length([rule, rule], [likely, None], [3.0, 3.0], 4, cpu) == 8
    assert ngram.tree_branch_length([rule, rule], [unsure, None], [3.0, 3.0], 4, cpu) == 0
    free = ngram.StepCosts(multi_token_step=0.0, per_token=0.0, draft=0.1)
    assert ngram.tree_branch_length([rule], [unsure], [3.0], 4, free) == 8  # verification free: the whole branch


def test_rule_learns_from_this_calls_outcomes():
    ngram = root._sibling("ngram_dflash2")
    cpu = rule(ngram, {"multi_token_step": 0.5, "per_token": 0.1, "draft": 0.25})
    match = ngram.NgramMatch([1, 2, 3, 4], 2)
    assert cpu.choose(match, None).proposer == "ngram"
    for _ in range(10):  # the n-gram keeps failing in this call (e.g. sampling at a high temperature)
        cpu.record(ngram.Proposal("ngram", 4), cpu.ngram_rates(match), 0)
    assert cpu.factor("ngram") < 0.3 and cpu.choose(match, None).proposer == "none"


def test_cut_drafts_and_plain_steps_stay_lossless(accepting, gen_module, monkeypatch):
    """With a CPU-like verification cost the rule verifies parts of drafts and sometimes nothing."""
    target, drafter, prompts = accepting
    pooled = gen_module.DFlash2Stats(block_size=drafter.config.block_size)
    for d in (drafter, tiny_drafter(target)):  # a confident and an unsure drafter, drafting every step
        monkeypatch.setattr(d.config, "hybrid_ngram", {"costs": {"multi_token_step": 0.2, "per_token": 0.3, "draft": 0.0}})
        for p in prompts:
            for new in (5, 23, 50):
                pooled.merge(_generate(gen_module, target, d, torch.tensor([p]), max_new_tokens=new, eos_token_id=None,
                                       prompt_lookup_num_tokens=0)[1])
    assert "none" in pooled.proposers  # plain one-token steps
    per_position = pooled.drafted_per_position  # steps that verified at least 1, 2, ... drafted tokens
    assert per_position[1] > 0 and per_position[0] > per_position[-1]  # multi-token drafts, cut before the block's end


# ---- lossless greedy --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_greedy_equals_target_with_ngram_steps(arch, gen_module, forced):
    target = tiny_target(arch)
    drafter = forced(tiny_drafter(target))
    used = 0
    for seed in range(3):
        ids = looping_prompt(target, seed=seed)[:, :20]
        for new in (1, 9, 33):
            _, stats = _generate(gen_module, target, drafter, ids, max_new_tokens=new, eos_token_id=None)
            used += stats.proposers.count("ngram")
    assert used > 0


def test_default_rule_is_lossless_and_uses_both_proposers(accepting, gen_module):
    target, drafter, prompts = accepting  # a confident drafter: the default rule mostly keeps its drafts
    for p in prompts:
        for new in (5, 23, 50):
            _generate(gen_module, target, drafter, torch.tensor([p]), max_new_tokens=new, eos_token_id=None)
    unsure = tiny_drafter(target)  # a random drafter (low confidence) on looping text: the n-gram wins there
    proposers = set()
    for seed in range(3):
        ids = looping_prompt(target, seed=seed)
        _, stats = _generate(gen_module, target, unsure, ids[:, : 6 + 4 * seed], max_new_tokens=40, eos_token_id=None)
        proposers |= set(stats.proposers)
    assert proposers == {"dflash2", "ngram"}


def test_match_runs_past_the_end_of_the_block(gen_module, forced):
    target = tiny_target("llama")
    drafter = forced(tiny_drafter(target))
    block = drafter.config.block_size
    ids = looping_prompt(target)
    _, stats = _generate(gen_module, target, drafter, ids, max_new_tokens=40, eos_token_id=None, prompt_lookup_num_tokens=block + 4)
    ngram_lengths = [n for n, p in zip(stats.accept_lengths, stats.proposers) if p == "ngram"]
    assert max(ngram_lengths) > block  # more tokens in one step than a block draft can propose


def test_match_at_the_very_start_uses_the_prompt_only(gen_module, forced):
    target = tiny_target("llama")
    drafter = forced(tiny_drafter(target))
    ids = looping_prompt(target)
    _, stats = _generate(gen_module, target, drafter, ids, max_new_tokens=12, eos_token_id=None)
    assert stats.proposers[0] == "ngram" and stats.accept_lengths[0] > 1  # the first step copies from the prompt


def test_eos_inside_an_ngram_continuation(gen_module, forced):
    target = tiny_target("llama")
    drafter = forced(tiny_drafter(target))
    ids = looping_prompt(target, seed=0)  # a loop of period 5
    free = target.generate(ids, do_sample=False, max_new_tokens=30, eos_token_id=None)[0, ids.shape[1] :].tolist()
    # a token the n-gram copies from the prompt, not the first generated one (that comes from the prefill)
    eos = next(t for pos, t in enumerate(free) if pos >= 2 and free.index(t) == pos and t in ids[0].tolist())
    out, stats = _generate(gen_module, target, drafter, ids, max_new_tokens=30, eos_token_id=eos)
    assert out[0, -1].item() == eos and out.shape[1] - ids.shape[1] == free.index(eos) + 1
    assert "ngram" in stats.proposers


@pytest.mark.parametrize("new", [1, 2, 3, 5, 8, 13])
def test_max_new_tokens_reached_mid_continuation(gen_module, forced, new):
    target = tiny_target("llama")
    drafter = forced(tiny_drafter(target))
    ids = looping_prompt(target)
    out, stats = _generate(gen_module, target, drafter, ids, max_new_tokens=new, eos_token_id=None, prompt_lookup_num_tokens=10)
    assert out.shape[1] == ids.shape[1] + new
    # the prefill makes one token and the last one is always the target's own: n-gram steps from 3 on
    assert ("ngram" in stats.proposers) == (new >= 3)


def test_prompt_lookup_knobs_set_the_hybrid(gen_module, forced):
    target = tiny_target("llama")
    drafter = forced(tiny_drafter(target))
    ids = looping_prompt(target)
    _, off = _generate(gen_module, target, drafter, ids, max_new_tokens=20, eos_token_id=None, prompt_lookup_num_tokens=0)
    assert "dflash2" in off.proposers and set(off.proposers) <= {"dflash2", "none"}  # "none": the last step, one token of room
    _, on = _generate(gen_module, target, drafter, ids, max_new_tokens=20, eos_token_id=None, prompt_lookup_num_tokens=3, max_matching_ngram_size=2)
    assert "ngram" in on.proposers and on.per_proposer["ngram"]["drafted"] <= 3 * on.proposers.count("ngram")
    for bad in ({"prompt_lookup_num_tokens": -1}, {"max_matching_ngram_size": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            target.generate(ids, assistant_model=drafter, max_new_tokens=3, **bad)


def test_stats_report_each_proposer(gen_module, forced):
    target = tiny_target("llama")
    drafter = forced(tiny_drafter(target))
    ids = looping_prompt(target)
    _, stats = _generate(gen_module, target, drafter, ids, max_new_tokens=30, eos_token_id=None)
    d = stats.as_dict()
    assert len(d["proposers"]) == d["steps"]
    assert sum(c["steps"] for c in d["per_proposer"].values()) == d["steps"]
    assert sum(c["accepted"] for c in d["per_proposer"].values()) == d["accepted"]


def test_drafts_after_skipped_drafter_steps_equal_training_time_drafts(accepting, gen_module):
    """Steps where the n-gram is certain skip the drafter; the context features of the tokens they
    commit wait and enter the next draft. Those drafts equal training's (one forward, all anchors)."""
    from dflash2_tools.training import features, forward

    target, drafter, prompts = accepting  # the default rule: certain on 4-token matches only
    ids = torch.tensor([prompts[2][:9]])  # new text first (the drafter drafts), then the target loops (skips)
    drafts, original = [], gen_module.Proposer.draft_block

    def spy(self, anchors, n):
        draft = original(self, anchors, n)
        drafts.append((self.lengths[0] - 1, draft.tokens[0].tolist()))  # the anchor's position
        return draft

    gen_module.Proposer.draft_block = spy
    try:
        out, stats = _generate(gen_module, target, drafter, ids, max_new_tokens=60, eos_token_id=None)
    finally:
        gen_module.Proposer.draft_block = original
    skipped = len(stats.proposers) - len(drafts)
    assert skipped > 0 and len(drafts) > 1, (skipped, len(drafts))
    cfg = drafter.config
    anchors = torch.tensor([[a for a, _ in drafts]])  # [1, n]
    with torch.no_grad():
        feats, _, _ = features.target_forward(target, out, torch.tensor([out.shape[1]]), cfg.target_layer_ids, cfg.target_hidden_reduction)
        hidden, logits, _, anchor_ids = forward.blocks_forward(drafter, target, forward.LossHead.of(drafter, target, "full"), out, torch.tensor([out.shape[1]]), anchors,
                                                             torch.ones_like(anchors, dtype=torch.bool), feats)
        walk = drafter.candidate_selector.walk(hidden[0], logits[0], anchor_ids[0])  # [n, B-1]
    for i, (_, drafted) in enumerate(drafts):
        assert walk.tokens[i, : len(drafted)].tolist() == drafted


def test_cpu_costs_gate_the_drafter_and_stay_lossless(accepting, gen_module, monkeypatch):
    """With this CPU's fp32 costs and the shipped calibration, a mean draft does not pay for its forward:
    the hybrid verifies n-gram continuations or makes plain steps, and stays exact."""
    target, drafter, prompts = accepting
    monkeypatch.setattr(drafter.config, "hybrid_ngram", {"costs": CPU_FP32_COSTS})
    proposers = set()
    for seed in range(2):
        ids = looping_prompt(target, seed=seed)[:, :12]
        proposers |= set(_generate(gen_module, target, drafter, ids, max_new_tokens=40, eos_token_id=None)[1].proposers)
    assert proposers == {"ngram", "none"}


def test_calibration_fits_and_replays_traced_steps():
    from dflash2_tools import calibrate_hybrid as cal

    ngram = root._sibling("ngram_dflash2")
    trace = [  # two calls (positions restart): whole-block drafts, n-gram continuations, what the target produced
        {"position": 10, "draft": [1, 2, 3], "confidence": [0.9, 0.9, 0.9], "ngram": [1, 2, 9], "match_length": 2},
        {"position": 13, "draft": [5, 6, 7], "confidence": [0.1, 0.1, 0.1], "ngram": [], "match_length": 0},
        {"position": 4, "draft": [8, 8, 8], "confidence": [0.5, 0.5, 0.5], "ngram": [4, 4, 4], "match_length": 2},
    ]
    outputs = {10: [1, 2, 3, 4], 13: [5, 0, 0], 4: [4, 4, 0]}
    steps = [cal.scored_steps([s], [0] * s["position"] + outputs[s["position"]])[0] for s in trace]
    assert [(s["draft_accepted"], s["ngram_accepted"]) for s in steps] == [(3, 2), (1, 0), (0, 2)]
    # match length 2: 4 accepted n-gram tokens against 2 first rejections -> 4 / 6
    assert cal.fit_ngram_acceptance(steps, 2) == [0.0, 0.0, round(4 / 6, 3)]
    assert cal.fit_drafter_acceptance(steps) == [round(2 / 3, 3), round(1 / 3, 3), round(1 / 3, 3)]
    rule = ngram.HybridRule([0.0, 0.0, 0.9], 1.0, 0.0, [0.5, 0.2, 0.1], ngram.StepCosts())
    # prompt lookup: whole n-gram where matched (2 + 1, 2 + 1 tokens), a plain step elsewhere (1)
    assert cal.replay(steps, rule, ngram, "ngram") == {"tokens_per_step": 7 / 3, "tokens_per_cost": 7 / 3}
    # no costs: every drafted token verified; the rule takes the better-scored proposal per step
    assert cal.replay(steps, rule, ngram, "dflash2")["tokens_per_step"] == (4 + 2 + 1) / 3


def test_calibration_traces_the_shipped_drafter():
    """The trace verifies one path per step whatever ``tree_budget`` ships (under its free costs "auto" would pick
    trees, which record no trace): a short call on the embedded target yields traced steps with both proposals."""
    import argparse

    from dflash2_tools import calibrate_hybrid as cal

    args = argparse.Namespace(target=cal.EMBEDDED_TARGET, drafter=str(root.REPO_ROOT), prompt_sets=["humaneval"], offset=20,
                              limit=1, max_new_tokens=12, dtype="float32")
    steps, settings, _ = cal.trace(args)
    assert steps and all(len(s["draft"]) > 0 and s["prompt_set"] == "humaneval" for s in steps)
    assert settings["max_n"] >= 1
