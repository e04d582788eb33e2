"""Batches through the one decoding loop (loop_dflash2.py): each row accepts its own tokens, every row stays lossless.

Greedy rows equal the target's own BATCHED generate of the same left-padded batch (fp32), across architectures,
mixed prompt lengths, EOS mid-batch, max_new_tokens edges, logits processors and return_dict; sampling keeps each
row's distribution (chi-square, with processors), and a verifier that ignores q fails the same test.
"""

from __future__ import annotations

import pytest
import torch
from conftest import CPU_FP32_COSTS, FREE_COSTS, overfit_drafter, root, tiny_drafter, tiny_target
from test_sampling import N_NEW, V, _processors, chi_square_p_value, exact_joint

LENGTHS = [3, 9, 5, 12, 1]  # mixed prompt lengths, left-padded to 12


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_moe"])
def accepting_batch(request):
    target = tiny_target(request.param)
    drafter, prompts = overfit_drafter(target, steps=60)
    width = max(LENGTHS)
    rows = [prompts[i % len(prompts)][:n] for i, n in enumerate(LENGTHS)]
    ids = torch.tensor([[0] * (width - len(p)) + p for p in rows])  # [5, 12]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])  # [5, 12]
    return target, drafter, ids, mask


def _mid_batch_eos(target, ids, mask) -> int:
    """A token some rows emit after a few steps and others do not: an EOS that ends rows at different times."""
    ref = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0, eos_token_id=None)
    return int(ref[:, ids.shape[1] + 5 :].flatten().mode().values)


@pytest.mark.parametrize("costs", [FREE_COSTS, CPU_FP32_COSTS], ids=["gpu-like-costs", "cpu-costs"])
def test_batched_greedy_equals_the_targets_batched_generate(accepting_batch, monkeypatch, costs):
    target, drafter, ids, mask = accepting_batch
    monkeypatch.setattr(drafter.config, "hybrid_ngram", {**drafter.config.hybrid_settings(), "costs": costs})
    eos = _mid_batch_eos(target, ids, mask)
    cases = [dict(max_new_tokens=1), dict(max_new_tokens=2), dict(max_new_tokens=30, eos_token_id=eos),
             dict(max_new_tokens=25, repetition_penalty=1.3), dict(max_new_tokens=17, no_repeat_ngram_size=3)]
    gen = root.generation()
    ran = set()
    for case in cases:
        kw = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None, **case}
        ref = target.generate(input_ids=ids, attention_mask=mask, **kw)
        with gen.collect_stats() as runs:
            out = target.generate(input_ids=ids, attention_mask=mask, assistant_model=drafter, **kw)
        assert torch.equal(ref, out), case
        ran |= set(runs[-1].per_proposer)
        if "eos_token_id" in case and case["eos_token_id"] is not None:  # EOS really ended rows at different times
            ends = [(row[ids.shape[1]:] == eos).nonzero() for row in ref]
            assert len({int(e[0]) if len(e) else -1 for e in ends}) > 1
    if costs is FREE_COSTS:  # verification is free: drafts are verified, not only plain steps
        assert "dflash2" in ran


def test_return_dict_scores_and_logits_match(accepting_batch):
    target, drafter, ids, mask = accepting_batch
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None, max_new_tokens=20, return_dict_in_generate=True,
              output_scores=True, output_logits=True, repetition_penalty=1.2)
    ref = target.generate(input_ids=ids, attention_mask=mask, **kw)
    out = target.generate(input_ids=ids, attention_mask=mask, assistant_model=drafter, **kw)
    assert torch.equal(ref.sequences, out.sequences)
    assert len(out.scores) == len(ref.scores) == 20 and len(out.logits) == 20
    for mine, theirs in [*zip(out.scores, ref.scores), *zip(out.logits, ref.logits)]:
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def test_streamer_gets_the_columns_transformers_gives(accepting_batch):
    target, drafter, ids, mask = accepting_batch

    class Recorder:
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    kw = dict(do_sample=False, pad_token_id=0, max_new_tokens=30, eos_token_id=_mid_batch_eos(target, ids, mask))
    mine, theirs = Recorder(), Recorder()
    target.generate(input_ids=ids, attention_mask=mask, streamer=theirs, **kw)
    target.generate(input_ids=ids, attention_mask=mask, assistant_model=drafter, streamer=mine, **kw)
    assert mine.puts == theirs.puts and mine.ended and theirs.ended


def test_holes_are_compacted_and_finished_rows_leave(accepting_batch, monkeypatch):
    """With compaction forced often (every step that made any hole) and rows ending early, rows stay equal."""
    target, drafter, ids, mask = accepting_batch
    holes = root.holes()
    monkeypatch.setattr(holes, "MIN_HOLES_TO_COMPACT", 1)
    calls = []
    real_compact = holes.compact
    monkeypatch.setattr(root.loop(), "compact", lambda cache, mask: calls.append(mask.shape) or real_compact(cache, mask))
    kw = dict(do_sample=False, pad_token_id=0, max_new_tokens=40, eos_token_id=_mid_batch_eos(target, ids, mask))
    ref = target.generate(input_ids=ids, attention_mask=mask, **kw)
    out = target.generate(input_ids=ids, attention_mask=mask, assistant_model=drafter, **kw)
    assert torch.equal(ref, out)
    assert calls  # the target's cache was compacted at least once


@pytest.mark.parametrize("min_holes", [1, 10_000], ids=["compact-every-step", "compact-when-full"])
def test_batched_static_cache_equals_the_targets_batched_generate(accepting_batch, monkeypatch, min_holes):
    """A static cache: holes cut by the layers' length, compacted in place (every step, or only when the next step
    would not fit the slots), rows ending at different times; equal to the target's own static batched generate."""
    target, drafter, ids, mask = accepting_batch
    monkeypatch.setattr(drafter.config, "hybrid_ngram", {**drafter.config.hybrid_settings(), "costs": FREE_COSTS})
    monkeypatch.setattr(root.holes(), "MIN_HOLES_TO_COMPACT", min_holes)
    calls = []
    real_compact = root.holes().compact
    monkeypatch.setattr(root.loop(), "compact", lambda cache, m: calls.append(m.shape) or real_compact(cache, m))
    eos = _mid_batch_eos(target, ids, mask)
    gen = root.generation()
    for case in (dict(max_new_tokens=1), dict(max_new_tokens=40, eos_token_id=eos), dict(max_new_tokens=33)):
        kw = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None, "cache_implementation": "static", **case}
        ref = target.generate(input_ids=ids, attention_mask=mask, **kw)
        with gen.collect_stats() as runs:
            out = target.generate(input_ids=ids, attention_mask=mask, assistant_model=drafter, **kw)
        assert torch.equal(ref, out), case
    assert calls  # compacted: every step, or because the holes filled the slots
    assert runs[-1].mean_acceptance_length > 1.5, runs[-1].as_dict()  # drafts were accepted on the static cache


@pytest.mark.parametrize("budget", [3, 8])
def test_batched_trees_equal_the_targets_batched_generate(accepting_batch, monkeypatch, budget):
    """A tree per row (its own lattice and n-gram branch), one forward under per-row tree masks over the holes, the
    accepted nodes moved to the front of the step's slots: rows equal to the target's own batched generate, with EOS
    mid-batch, processors, scores, and a static cache."""
    target, drafter, ids, mask = accepting_batch
    monkeypatch.setattr(drafter.config, "tree_budget", budget)
    eos = _mid_batch_eos(target, ids, mask)
    gen = root.generation()
    cases = [dict(max_new_tokens=1), dict(max_new_tokens=30, eos_token_id=eos), dict(max_new_tokens=25, repetition_penalty=1.3),
             dict(max_new_tokens=30, eos_token_id=eos, cache_implementation="static"),
             dict(max_new_tokens=12, return_dict_in_generate=True, output_scores=True, output_logits=True)]
    for case in cases:
        kw = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None, **case}
        ref = target.generate(input_ids=ids, attention_mask=mask, **kw)
        with gen.collect_stats() as runs:
            out = target.generate(input_ids=ids, attention_mask=mask, assistant_model=drafter, **kw)
        if case.get("return_dict_in_generate"):
            assert torch.equal(ref.sequences, out.sequences)
            for mine, theirs in [*zip(out.scores, ref.scores), *zip(out.logits, ref.logits)]:
                torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
            continue
        assert torch.equal(ref, out), case
        assert set(runs[-1].proposers) == ({"dflash2-tree"} if case["max_new_tokens"] > 1 else set())
    assert runs[-1].mean_acceptance_length > 1.5, runs[-1].as_dict()  # the trees' nodes were accepted


DEAR_COSTS = {"multi_token_step": 0.0, "per_token": 0.38, "draft": 0.55}  # emulated bf16 on an AVX2 CPU


@pytest.mark.parametrize("costs", [FREE_COSTS, DEAR_COSTS], ids=["gpu-like-costs", "dear-costs"])
def test_auto_tree_budget_decides_with_the_batchs_costs(accepting_batch, monkeypatch, costs):
    """``tree_budget="auto"`` (the shipped setting) in a batch: where verification is free a tree per row, where each
    token of a batched forward is dear (emulated bf16 on an AVX2 CPU) paths; the batch's rows equal the target's
    either way."""
    target, drafter, ids, mask = accepting_batch
    monkeypatch.setattr(drafter.config, "tree_budget", "auto")
    monkeypatch.setattr(drafter.config, "hybrid_ngram", {**drafter.config.hybrid_settings(), "costs": costs})
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None, max_new_tokens=20)
    ref = target.generate(input_ids=ids, attention_mask=mask, **kw)
    with root.generation().collect_stats() as runs:
        out = target.generate(input_ids=ids, attention_mask=mask, assistant_model=drafter, **kw)
    assert torch.equal(ref, out)
    assert ("dflash2-tree" in runs[-1].proposers) == (costs is FREE_COSTS), runs[-1].proposers


def test_kept_first_moves_each_rows_accepted_nodes_to_the_front_of_the_step():
    from transformers.cache_utils import DynamicCache

    holes = root.holes()
    cache = DynamicCache()
    keys = torch.arange(2 * 7, dtype=torch.float32).view(2, 1, 7, 1).expand(2, 2, 7, 3).contiguous()  # 2 rows, 3 past + 4 step
    cache.update(keys, keys + 100, 0)
    order = holes.kept_first(cache, 3, [[0, 2, 1], [0, 3]], kept=3)  # row 1 keeps 2 slots: its third is its own
    assert order.tolist() == [[0, 2, 1], [0, 3, 2]]
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 5, 4, 6]  # the past is untouched
    assert cache.layers[0].values[1, 1, :, 0].tolist() == [107, 108, 109, 110, 113, 112, 113]
    assert holes.kept_first(cache, 3, [[0, 1, 2], [0, 1]], kept=3) is None  # chains: nothing moves
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 5, 4, 6]


def test_stopping_criteria_run_once_per_group_of_equal_length_rows():
    """transformers' length and EOS criteria are applied on the host (no call, no transfer); any other criterion runs
    once per group of rows of equal length (one transfer); every row gets what a call of its own (``as_row``) gives."""
    from transformers import StoppingCriteria, StoppingCriteriaList
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    batch = root.loop()
    calls = []

    class EndsWithSix(StoppingCriteria):  # reads each row's own tokens
        def __call__(self, ids, scores, **kwargs):
            calls.append(ids.shape)
            return ids[:, -1] == 6

    builtin = StoppingCriteriaList([MaxLengthCriteria(max_length=7), EosTokenCriteria(eos_token_id=5)])
    sequences = {0: [1, 2, 3, 4], 2: [1, 2, 5], 3: [1, 2, 3, 4, 6, 6, 1], 4: [1, 2, 3, 6], 5: [1, 2, 3, 5]}
    for criteria, want, n_calls in ((builtin, {2, 3, 5}, 0), (StoppingCriteriaList([*builtin, EndsWithSix()]), {2, 3, 4, 5}, 3)):
        stopped = batch.stopping_rule(criteria, rows=6, device="cpu")(sequences)
        assert len(calls) == n_calls and all(shape[0] == 6 for shape in calls)  # lengths 4, 3 and 7
        calls.clear()
        one_by_one = {r for r, ids in sequences.items() if root.accept().as_row(criteria, ids, r, 6, "cpu")}
        calls.clear()
        assert stopped == one_by_one == want


def test_compact_moves_each_rows_real_entries_together_in_order():
    from transformers.cache_utils import DynamicCache

    holes = root.holes()
    cache = DynamicCache()
    keys = torch.arange(3 * 2 * 6 * 1, dtype=torch.float32).view(3, 2, 6, 1)  # [b, h, T, d]
    cache.update(keys.clone(), -keys.clone(), 0)
    mask = torch.tensor([[0, 1, 0, 1, 1, 0], [1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 1, 0]])
    new_mask = holes.compact(cache, mask)
    assert new_mask.tolist() == [[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]]
    layer = cache.layers[0]
    assert layer.keys.shape == (3, 2, 4, 1)
    for row, kept in enumerate([[1, 3, 4], [0, 1, 2, 3], [4]]):
        assert layer.keys[row, 1, -len(kept):, 0].tolist() == keys[row, 1, kept, 0].tolist()
        assert layer.values[row, 0, -len(kept):, 0].tolist() == (-keys[row, 0, kept, 0]).tolist()


def test_batch_cost_model_prices_a_batch_above_one_row():
    """The same draft length costs a batch more (relative to its plain step) than one row: the rule cuts sooner."""
    proposer = root.costs_of(tiny_drafter())
    costs = root.ngram_of(tiny_drafter()).StepCosts(**CPU_FP32_COSTS)
    assert proposer.batch_step_costs(costs, 1) is costs
    four = proposer.batch_step_costs(costs, 4)
    assert four.verify(8) > costs.verify(8) - costs.multi_token_step  # per drafted token, a batch pays more
    assert four.verify(0) == 1.0 and four.per_token > costs.per_token


def test_a_batch_measures_its_own_costs(accepting_batch, monkeypatch):
    """A batch is measured at its own size (one row's costs do not say what a batch's step costs)."""
    target, drafter, ids, mask = accepting_batch
    monkeypatch.setattr(drafter.config, "hybrid_ngram", {**drafter.config.hybrid_settings(), "costs": None})
    with root.generation().collect_stats() as runs:
        target.generate(input_ids=ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert runs[-1].costs["source"] == f"measured at batch {ids.shape[0]}"
    assert runs[-1].costs["batch"]["per_token"] >= 0


def test_the_benchmarks_forced_rules_force_what_they_say(accepting_batch, monkeypatch):
    """``--batch-rules longest / plain`` (the extremes the rule is checked against): free costs verify drafts at
    every step, prohibitive ones only plain batched steps; both stay equal to the target."""
    from dflash2_tools.bench_batch import FORCED_COSTS

    target, drafter, ids, mask = accepting_batch
    ref = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    steps = {}
    for rule, costs in FORCED_COSTS.items():
        monkeypatch.setattr(drafter.config, "hybrid_ngram", {**drafter.config.hybrid_settings(), "costs": costs})
        with root.generation().collect_stats() as runs:
            out = target.generate(input_ids=ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=12,
                                  do_sample=False, pad_token_id=0)
        assert torch.equal(out, ref), rule
        steps[rule] = runs[-1].per_proposer
    assert set(steps["plain"]) == {"none"}
    assert steps["longest"].get("dflash2", {}).get("steps", 0) > 0
    assert runs[-1].costs["source"] == "config"


def test_a_batch_measurement_runs_over_a_context_and_repeats(accepting_batch, monkeypatch):
    """A batch's costs come from at least MIN_ROUNDS rounds over a context (one short round flipped the rule)."""
    costs_module = root.costs_of(accepting_batch[1])
    target, drafter, ids, _ = accepting_batch
    calls = []
    real_forward = type(target).forward

    def counting_forward(self, *args, **kwargs):
        cache = kwargs.get("past_key_values")
        calls.append(0 if cache is None else cache.get_seq_length())
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(type(target), "forward", counting_forward)
    lm_head = drafter.draft_head(target.get_output_embeddings())
    costs = costs_module.measure_step_costs(target, drafter, lm_head, torch.device("cpu"), rows=3)
    widths = len(costs["curve"])  # 1, 2, 4, 8, 16, the longest path, a 32-node tree
    assert widths == 7 and calls.count(costs_module.CONTEXT_TOKENS) >= widths * (costs_module.MIN_ROUNDS + 1)  # + the warm-up
    assert min(costs["multi_token_step"], costs["per_token"], costs["draft"]) >= 0


def test_the_batch_verifies_what_its_slowest_row_can_use():
    """One length for the batch: where verification costs, a row with nothing to verify keeps the batch at a plain
    step (the batch waits for its slowest row); where it is free, the longest proposal is verified."""
    ngram = root.ngram_of(tiny_drafter())
    bp = ngram
    rule = lambda costs: ngram.HybridRule([0.0, 0.5, 0.7, 0.9], 1.0, 0.0, [0.8] * 7, costs)  # noqa: E731
    good = bp.PathProposal(ngram.Proposal("ngram", 6), [0.9] * 6, [5, 6, 7, 8, 9, 10])
    nothing = bp.PathProposal(ngram.Proposal("none", 0), [], [])
    cpu = root.costs_of(tiny_drafter()).batch_step_costs(ngram.StepCosts(**CPU_FP32_COSTS), 2)
    free = ngram.StepCosts(**FREE_COSTS)
    assert bp.batch_length([good, nothing], [rule(cpu), rule(cpu)], cpu) == 0
    assert bp.batch_length([good, good], [rule(cpu), rule(cpu)], cpu) > 0
    assert bp.batch_length([good, nothing], [rule(free), rule(free)], free) == 6


def test_the_batch_drafts_only_when_its_slowest_row_gains():
    """Before drafting, the batch is valued like a step (``batch_length``): by the row that gains least, the draft's
    own forward included. A weak drafter next to strong n-gram continuations does not run; a good one does where
    verification is free, and nothing runs at prohibitive costs."""
    ngram = root.ngram_of(tiny_drafter())
    bp = ngram
    match = ngram.NgramMatch([5, 6, 7, 8, 9, 10], 3)
    rule = lambda acceptance, costs: ngram.HybridRule([0.0, 0.5, 0.7, 0.9], 1.0, 0.0, acceptance, costs)  # noqa: E731
    free = ngram.StepCosts(**FREE_COSTS)
    cpu = root.costs_of(tiny_drafter()).batch_step_costs(ngram.StepCosts(**CPU_FP32_COSTS), 2)
    costly = ngram.StepCosts(multi_token_step=10.0, per_token=10.0, draft=10.0)
    strong = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]
    weak = [0.05] * 7
    assert bp.draft_pays([rule(strong, free)] * 2, [match, None], [7, 7], free)  # the row without a match gains
    assert not bp.draft_pays([rule(weak, cpu)] * 2, [match, match], [7, 7], cpu)  # both rows are served by their n-gram
    assert not bp.draft_pays([rule(strong, costly)] * 2, [None, None], [7, 7], costly)
    assert not bp.draft_pays([rule(strong, free)] * 2, [None, None], [0, 0], free)  # nothing may be drafted


def test_a_batch_on_a_sliding_window_cache_commits_in_lockstep_and_stays_exact(accepting_batch):
    """A cache whose layers keep a window (counted in slots) cannot take holes: the rows commit the least any row
    accepted (a prefix of each row's own tokens), and equal the target's own batched generate on the same cache."""
    from transformers import StaticCache
    from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

    target, drafter, ids, mask = accepting_batch
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)

    def windowed():
        return Cache(layers=[DynamicSlidingWindowLayer(sliding_window=64) for _ in range(target.config.num_hidden_layers)])

    ref = target.generate(**kw, past_key_values=windowed())
    with root.generation().collect_stats() as runs:
        out = target.generate(**kw, assistant_model=drafter, past_key_values=windowed())
    assert torch.equal(ref, out)
    lengths = runs[-1].row_accept_lengths
    assert all(a == b for a, b in zip(lengths[0], lengths[1]))  # lockstep: every row the same per step
    assert runs[-1].drafted > 0  # drafts were verified (whether all rows kept them varies by architecture)
    # a user's own static cache is served (no room reserved beyond its slots: the last steps draft less)
    kw = {**kw, "max_new_tokens": 4}
    ref = target.generate(**kw, past_key_values=StaticCache(config=target.config, max_cache_len=16))
    out = target.generate(**kw, assistant_model=drafter, past_key_values=StaticCache(config=target.config, max_cache_len=16))
    assert torch.equal(ref, out)


@pytest.mark.parametrize("arch", ["glm5_next", "qwen3_next"])
def test_a_batch_of_a_stateful_target_equals_its_batched_generate(arch):
    """Linear-attention targets (the seed's own GLM-5.3-Flash is one) in a batch: mixed prompt lengths, an EOS that
    ends rows at different steps; each step's recurrent state is rolled back and replayed over the tokens every row
    commits (lockstep), so every row equals the target's own batched greedy generate."""
    from test_stateful import drafter_for

    from dflash2_tools import tiny_targets

    target = getattr(tiny_targets, f"tiny_{arch}")()
    shape = drafter_for(target).config
    drafter, prompts = overfit_drafter(target, steps=60, target_layer_ids=shape.target_layer_ids,
                                       target_hidden_reduction=shape.target_hidden_reduction, conv_group_size=8)
    lengths = [3, 9, 1, 6]
    rows = [prompts[i % len(prompts)][:n] for i, n in enumerate(lengths)]
    ids = torch.tensor([[0] * (9 - len(p)) + p for p in rows])  # [4, 9] left-padded
    mask = (torch.arange(9)[None] >= torch.tensor([9 - n for n in lengths])[:, None]).long()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    ref = target.generate(**kw, eos_token_id=None)
    eos = int(ref[:, 9 + 4 :].flatten().mode().values)  # a token some rows emit mid-way
    ref = target.generate(**kw, eos_token_id=eos)
    with root.generation().collect_stats() as runs:
        out = target.generate(**kw, eos_token_id=eos, assistant_model=drafter)
    assert torch.equal(ref, out)
    assert runs[-1].drafted > 0 and runs[-1].rollback_seconds > 0  # drafts verified, states rolled back
    with root.generation().collect_stats() as runs:  # one prompt: a batch of one through the same loop
        one = target.generate(**{**kw, "input_ids": ids[1:2], "attention_mask": mask[1:2]}, eos_token_id=eos, assistant_model=drafter)
    assert torch.equal(one, ref[1:2, : one.shape[1]])
    assert runs[-1].accepted > 0, runs[-1].as_dict()  # drafts were accepted in part: the state was replayed


# ---- sampling ------------------------------------------------------------------------------------------------------

SAMPLES = 600
PROMPTS = [[1, 3, 2], [4, 1]]  # two rows of different lengths, one batch


@pytest.fixture(scope="module")
def sampling_setup():
    target = tiny_target("llama", vocab=V, hidden=48, layers=3, seed=5)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(0.35)
    target.generation_config.eos_token_id = None
    drafter = tiny_drafter(target, seed=7, mask_token_id=V - 1, selector_top_k=3, block_size=4, conv_group_size=16)
    with torch.no_grad():
        drafter.candidate_selector.hidden_projection.weight.normal_(0, 2.0)
    ids = torch.tensor([[0] * (3 - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (3 - len(p)) + [1] * len(p) for p in PROMPTS])
    return target, drafter, ids, mask


def _batched_counts(target, drafter, ids, mask, gen_kw, n):
    counts = [{} for _ in PROMPTS]
    for seed in range(n):
        torch.manual_seed(seed)
        out = target.generate(input_ids=ids, attention_mask=mask, assistant_model=drafter, do_sample=True, max_new_tokens=N_NEW, **gen_kw)
        for row, row_counts in enumerate(counts):
            cell = tuple(out[row, ids.shape[1] :].tolist())
            row_counts[cell] = row_counts.get(cell, 0) + 1
    return counts


@pytest.mark.parametrize("temperature, top_p, repetition_penalty, tree_budget",
                         [(1.0, 1.0, 1.0, None), (0.7, 0.9, 1.3, None), (0.7, 0.9, 1.3, 4)], ids=["plain", "processors", "trees"])
def test_batched_sampling_keeps_each_rows_distribution(sampling_setup, monkeypatch, temperature, top_p, repetition_penalty,
                                                       tree_budget):
    target, drafter, ids, mask = sampling_setup
    monkeypatch.setattr(drafter.config, "hybrid_ngram", {**drafter.config.hybrid_settings(), "costs": FREE_COSTS})
    monkeypatch.setattr(drafter.config, "tree_budget", tree_budget)
    gen_kw = dict(temperature=temperature, top_p=top_p, top_k=0, repetition_penalty=repetition_penalty, pad_token_id=0)
    with root.generation().collect_stats() as runs:
        counts = _batched_counts(target, drafter, ids, mask, gen_kw, SAMPLES)
    assert sum(r.drafted for r in runs) > 0
    for prompt, row_counts in zip(PROMPTS, counts):
        expected = exact_joint(target, torch.tensor([prompt]), _processors(temperature, top_p, repetition_penalty))
        assert chi_square_p_value(row_counts, expected, SAMPLES) > 1e-3, prompt


def test_a_batched_verifier_that_ignores_q_fails(sampling_setup, monkeypatch):
    target, drafter, ids, mask = sampling_setup
    monkeypatch.setattr(drafter.config, "hybrid_ngram", {**drafter.config.hybrid_settings(), "costs": FREE_COSTS})

    def ignores_q(p, children, q, generator=None):
        # accept a draft with probability p(draft), else resample from p: the proposal q is never used
        keep = torch.rand(children.shape, generator=generator) < p.gather(1, children[:, None])[:, 0]
        return torch.where(keep, children, torch.multinomial(p, 1, generator=generator)[:, 0])

    monkeypatch.setattr(root.accept(), "_draws_against_q", ignores_q)
    counts = _batched_counts(target, drafter, ids, mask, dict(temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0), SAMPLES)
    rejected = [chi_square_p_value(c, exact_joint(target, torch.tensor([p]), _processors(1.0, 1.0, 1.0)), SAMPLES) < 1e-3
                for p, c in zip(PROMPTS, counts)]
    assert any(rejected)
