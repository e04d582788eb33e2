"""Lossless speculative generation through the plain ``target.generate(..., assistant_model=drafter)`` call."""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import VOCAB, pretend_transformers_version, root, tiny_drafter, tiny_target
from transformers.generation.streamers import BaseStreamer


def _assert_same(target, drafter, ids, **kw):
    ref = target.generate(ids, do_sample=False, **kw)
    out = target.generate(ids, assistant_model=drafter, do_sample=False, **kw)
    assert torch.equal(ref, out), (ref.tolist(), out.tolist())
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_greedy_equals_target_with_random_drafter(arch):
    target = tiny_target(arch)
    drafter = tiny_drafter(target)
    g = torch.Generator().manual_seed(1)
    for prompt_len, new in [(1, 1), (2, 7), (4, 30), (13, 17), (40, 25)]:
        ids = torch.randint(0, VOCAB - 2, (1, prompt_len), generator=g)
        _assert_same(target, drafter, ids, max_new_tokens=new)


def test_greedy_equals_target_with_accepting_drafter(accepting, gen_module):
    target, drafter, prompts = accepting
    total_steps, total_tokens = 0, 0
    for p in prompts:
        for new in (1, 4, 5, 6, 23, 50):
            ids = torch.tensor([p])
            ref = target.generate(ids, do_sample=False, max_new_tokens=new)
            out, stats = gen_module.dflash2_generate(target, drafter, ids, do_sample=False, max_new_tokens=new)
            assert torch.equal(ref, out)
            total_steps += len(stats.accept_lengths)
            total_tokens += sum(stats.accept_lengths)
    # the accept path is really exercised: several tokens per target forward on average
    assert total_tokens / total_steps > 2.5


def test_many_prompt_lengths_with_accepting_drafter(accepting):
    target, drafter, prompts = accepting
    base = prompts[1]
    for cut in range(1, len(base) + 1):
        _assert_same(target, drafter, torch.tensor([base[:cut]]), max_new_tokens=11 + cut)


def test_eos_inside_a_block(accepting, gen_module):
    target, drafter, prompts = accepting
    ids = torch.tensor([prompts[1]])
    free = target.generate(ids, do_sample=False, max_new_tokens=40, eos_token_id=None)[0, ids.shape[1] :].tolist()
    stats_seen = False
    for pos in (3, 9, 14):
        eos = free[pos]
        first = free.index(eos)
        for eos_arg in (eos, [VOCAB - 1, eos]):
            ref = target.generate(ids, do_sample=False, max_new_tokens=40, eos_token_id=eos_arg, pad_token_id=0)
            out, stats = gen_module.dflash2_generate(target, drafter, ids, do_sample=False, max_new_tokens=40, eos_token_id=eos_arg, pad_token_id=0)
            assert torch.equal(ref, out)
            assert out.shape[1] - ids.shape[1] == first + 1  # stopped right after the first EOS
            stats_seen |= any(length > 1 for length in stats.accept_lengths)
    assert stats_seen


def test_max_length_is_exact(accepting):
    target, drafter, prompts = accepting
    ids = torch.tensor([prompts[0]])
    for max_length in range(ids.shape[1] + 1, ids.shape[1] + 14):
        out = _assert_same(target, drafter, ids, max_length=max_length, eos_token_id=None, pad_token_id=0)
        assert out.shape[1] == max_length


class _Collect(BaseStreamer):
    def __init__(self):
        self.chunks = []
        self.ended = False

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.ended = True


def test_streamer_streams_the_same_tokens(accepting):
    target, drafter, prompts = accepting
    ids = torch.tensor([prompts[0]])
    a, b = _Collect(), _Collect()
    target.generate(ids, do_sample=False, max_new_tokens=30, streamer=a)
    target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=30, streamer=b)
    flat = lambda c: [t for chunk in c.chunks for t in chunk]  # noqa: E731
    assert flat(a) == flat(b) and a.ended and b.ended
    assert len(b.chunks) < len(a.chunks)  # several tokens per chunk: drafts were accepted


def test_prompt_longer_than_sliding_window():
    target = tiny_target("llama")
    drafter = tiny_drafter(target, use_sliding_window=True, sliding_window=6)
    ids = torch.randint(0, VOCAB - 2, (1, 40), generator=torch.Generator().manual_seed(3))
    _assert_same(target, drafter, ids, max_new_tokens=30)


def test_attention_mask_from_caller(accepting):
    target, drafter, prompts = accepting
    ids = torch.tensor([prompts[2]])
    _assert_same(target, drafter, ids, attention_mask=torch.ones_like(ids), max_new_tokens=20)


def test_no_memory_growth_over_100_calls(accepting):
    target, drafter, prompts = accepting
    ids = torch.tensor([prompts[0]])

    def live_tensors():
        gc.collect()
        return sum(1 for o in gc.get_objects() if torch.is_tensor(o))

    for _ in range(3):
        target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=12)
    before = live_tensors()
    for _ in range(100):
        target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=12)
    assert live_tensors() <= before + 5


def test_incompatible_targets_are_refused():
    target = tiny_target("llama")
    ids = torch.tensor([[1, 2, 3]])
    for bad, what in [
        (tiny_drafter(tiny_target("llama", vocab=VOCAB + 4)), "vocab"),
        (tiny_drafter(tiny_target("llama", hidden=96)), "hidden size"),
        (tiny_drafter(tiny_target("llama", layers=9)), "layers"),
    ]:
        with pytest.raises(ValueError, match=what) as info:
            target.generate(ids, assistant_model=bad, max_new_tokens=5)
        assert "this drafter expects" in str(info.value)


def test_bf16_greedy_and_sampling_run():
    """bf16 target and drafter (the fast CPU setting): both modes run and produce the requested length."""
    target = tiny_target("llama").to(torch.bfloat16)
    drafter = tiny_drafter(target).to(torch.bfloat16)
    ids = torch.tensor([[1, 2, 3, 4]])
    for kw in (dict(do_sample=False), dict(do_sample=True, temperature=0.8)):
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=20, eos_token_id=None, pad_token_id=0, **kw)
        assert out.shape == (1, 24)


def test_device_and_dtype_mismatch_is_refused():
    target = tiny_target("llama")
    drafter = tiny_drafter(target).to(torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        target.generate(torch.tensor([[1, 2, 3]]), assistant_model=drafter, max_new_tokens=5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_beams=2), "beam search"),
        (dict(num_beams=2, do_sample=True), "beam sampling"),
        (dict(penalty_alpha=0.6, top_k=4), "contrastive"),
        (dict(num_return_sequences=2, do_sample=True), "num_return_sequences"),
    ],
)
def test_unsupported_modes_are_refused(kwargs, message):
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    with pytest.raises(ValueError, match=message):
        target.generate(torch.tensor([[1, 2, 3]]), assistant_model=drafter, max_new_tokens=5, **kwargs)


def test_a_batch_without_a_mask_equals_the_targets_batched_generate():
    """Batches are served (tests/test_batch.py); equal-length rows with no attention mask too."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    want = target.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(target.generate(ids, assistant_model=drafter, max_new_tokens=5, do_sample=False, pad_token_id=0), want)


def test_builtin_dflash_path_still_works(accepting):
    """transformers' own DFlash path (argmax drafting, no selector) runs our drafter losslessly."""
    target, drafter, prompts = accepting
    ids = torch.tensor([prompts[0]])
    ref = target.generate(ids, do_sample=False, max_new_tokens=30)
    out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=30, speculation_type="dflash")
    assert torch.equal(ref, out)


def test_version_guard(monkeypatch, gen_module):
    pretend_transformers_version(monkeypatch, "5.99.0")
    with pytest.raises(RuntimeError, match="tested with transformers"):
        gen_module.check_transformers_version()


def test_stats_object(accepting, gen_module):
    target, drafter, prompts = accepting
    out, stats = gen_module.dflash2_generate(target, drafter, torch.tensor([prompts[0]]), do_sample=False, max_new_tokens=30)
    d = stats.as_dict()
    assert d["new_tokens"] == out.shape[1] - len(prompts[0])
    assert sum(stats.accept_lengths) + 1 >= d["new_tokens"]  # +1: the prefill's token
    assert d["accepted"] == sum(a - 1 for a in stats.accept_lengths)
    rates = stats.per_position_acceptance
    assert len(rates) == drafter.config.block_size - 1 and all(0 <= r <= 1 for r in rates)
    assert sum(stats.histogram().values()) == len(stats.accept_lengths)


@pytest.mark.parametrize("n, schedule", [(1, "constant"), (3, "constant"), (2, "heuristic")])
def test_shorter_drafts_stay_lossless(accepting, gen_module, n, schedule):
    target, drafter, prompts = accepting
    drafted = [0] * (drafter.config.block_size - 1)  # per draft position, over all prompts
    for p in prompts[:3]:
        ids = torch.tensor([p])
        ref = target.generate(ids, do_sample=False, max_new_tokens=40)
        out, stats = gen_module.dflash2_generate(
            target, drafter, ids, do_sample=False, max_new_tokens=40, num_assistant_tokens=n, num_assistant_tokens_schedule=schedule
        )
        assert torch.equal(ref, out)
        drafted = [a + b for a, b in zip(drafted, stats.drafted_per_position)]
    if schedule == "constant":  # never more than n tokens go to the target
        assert all(d == 0 for d in drafted[n:]) and drafted[n - 1] > 0
    else:  # the accepting drafter earns longer drafts than it started with
        assert any(d > 0 for d in drafted[n:])


def test_bad_draft_length_is_refused(accepting):
    target, drafter, prompts = accepting
    ids = torch.tensor([prompts[0]])
    with pytest.raises(ValueError, match="num_assistant_tokens must be an integer >= 1"):
        target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=5, num_assistant_tokens=0)
    with pytest.raises(ValueError, match="num_assistant_tokens_schedule"):
        target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=5, num_assistant_tokens_schedule="fast")


def _emitted_tokens(target, prompts, max_new_tokens=40):
    seen = set()
    for p in prompts:
        seen |= set(target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new_tokens)[0].tolist())
    return seen


def test_draft_vocabulary_covering_the_output_drafts_the_same(accepting, gen_module, monkeypatch):
    """A draft vocabulary holding every token the target emits gives the very same drafts, step for step."""
    target, drafter, prompts = accepting
    full = [gen_module.dflash2_generate(target, drafter, torch.tensor([p]), do_sample=False, max_new_tokens=40) for p in prompts]
    # the emitted tokens plus odd filler ids, so the sub-vocabulary is neither sorted by use nor the full table
    vocab = sorted(_emitted_tokens(target, prompts) | set(range(5, VOCAB, 7)))
    assert len(vocab) < VOCAB - 10
    monkeypatch.setattr(drafter.config, "draft_vocab_ids", vocab)
    for p, (ref, ref_stats) in zip(prompts, full):
        out, stats = gen_module.dflash2_generate(target, drafter, torch.tensor([p]), do_sample=False, max_new_tokens=40)
        assert torch.equal(ref, out)
        assert stats.accept_lengths == ref_stats.accept_lengths


@pytest.mark.parametrize("selector", [True, False], ids=["selector", "argmax"])
def test_draft_vocabulary_missing_tokens_stays_lossless(accepting, selector, monkeypatch):
    """Tokens the target emits but the draft vocabulary lacks are never drafted; output is still the target's."""
    target, drafter, prompts = accepting
    saved_selector = drafter.candidate_selector
    if not selector:  # restored in finally: monkeypatch does not restore a registered submodule
        drafter.candidate_selector = None
    try:
        _draft_with_missing_tokens(target, drafter, prompts, monkeypatch)
    finally:
        drafter.candidate_selector = saved_selector


def _draft_with_missing_tokens(target, drafter, prompts, monkeypatch):
    emitted = sorted(_emitted_tokens(target, prompts[:2]))
    vocab = [t for t in range(VOCAB) if t not in emitted[::2]]  # every other emitted token is missing
    monkeypatch.setattr(drafter.config, "draft_vocab_ids", vocab)
    drafted_tokens = []
    gen = root.proposer_of(drafter)  # the module whose Proposer calls propose
    original = gen.propose

    def spy(*args, **kwargs):
        draft = original(*args, **kwargs)
        drafted_tokens.extend(draft.tokens.flatten().tolist())
        return draft

    monkeypatch.setattr(gen, "propose", spy)
    for p in prompts[:2]:
        _assert_same(target, drafter, torch.tensor([p]), max_new_tokens=40)
    assert drafted_tokens and set(drafted_tokens) <= set(vocab)


def test_generation_drafts_equal_training_time_drafts(accepting, gen_module, monkeypatch):
    """The blocks generation proposes equal what training computes for the same anchors: all of a
    sequence's blocks in ONE forward under the multi-block training mask, from one target forward
    over the final sequence (so the incremental context cache is what training assumes)."""
    from dflash2_tools.training import features, forward

    target, drafter, prompts = accepting
    cfg = drafter.config
    steps = []  # (anchor position, drafted tokens)
    original = gen_module.Proposer.propose

    def spy(self, *args, **kwargs):
        proposals = original(self, *args, **kwargs)  # one row: [its path]
        if proposals[0].tokens:
            steps.append((self.lengths[0] - 1, list(proposals[0].tokens)))  # the anchor's position
        return proposals

    monkeypatch.setattr(gen_module.Proposer, "propose", spy)
    ids = torch.tensor([prompts[2][:9]])  # a prefix the drafter did not see whole in training
    out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=35, eos_token_id=None, pad_token_id=0,
                          prompt_lookup_num_tokens=0)  # the block draft alone (no n-gram proposals)
    assert len(steps) > 3
    length = out.shape[1]
    anchors = torch.tensor([[a for a, _ in steps]])  # [1, n]
    lengths = torch.tensor([length])
    with torch.no_grad():  # exactly training's path: one target forward, all blocks in one drafter forward
        feats, _, _ = features.target_forward(target, out, lengths, cfg.target_layer_ids, cfg.target_hidden_reduction)
        hidden, logits, _, anchor_ids = forward.blocks_forward(drafter, target, forward.LossHead.of(drafter, target, "full"), out, lengths, anchors, torch.ones_like(anchors, dtype=torch.bool), feats)
        walk = drafter.candidate_selector.walk(hidden[0], logits[0], anchor_ids[0])  # [n, B-1] drafts
    for i, (_, drafted) in enumerate(steps):
        assert walk.tokens[i, : len(drafted)].tolist() == drafted


def test_on_policy_dev_acceptance_equals_what_generation_measures(accepting, gen_module, monkeypatch):
    """Training's on-policy dev metric (blocks at EVERY response anchor, then the greedy verifier's
    walk over them) reproduces, step by step, the acceptance of the plain generate call on the
    target's own greedy text."""
    import contextlib

    from dflash2_tools.training import evaluate, features, forward
    from dflash2_tools.training import loss as losses

    target, drafter, prompts = accepting
    accepted = []
    original = gen_module.DFlash2Stats.record_step

    def spy(self, drafted, n_accepted, *args):
        accepted.append(n_accepted)
        return original(self, drafted, n_accepted, *args)

    monkeypatch.setattr(gen_module.DFlash2Stats, "record_step", spy)
    ids = torch.tensor([prompts[2][:9]])
    out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=40, eos_token_id=None, pad_token_id=0,
                          prompt_lookup_num_tokens=0)  # the block draft alone (no n-gram proposals)
    assert len(accepted) > 3 and max(accepted) >= 2  # a drafter that does accept
    lengths = torch.tensor([out.shape[1]])
    cfg = drafter.config
    with torch.no_grad():
        feats, _, _ = features.target_forward(target, out, lengths, cfg.target_layer_ids, cfg.target_hidden_reduction)
    acc = evaluate.response_acceptance(drafter, target, forward.LossHead.of(drafter, target), out, lengths, ids.shape[1], feats,
                                       contextlib.nullcontext, chunk=7)
    steps = losses.greedy_verifier_steps(acc["selector"].tolist())
    # every step but the last (where generation drafts one token less, to leave room for its own token)
    assert len(steps) == len(accepted)
    assert steps[:-1] == [a + 1 for a in accepted[:-1]]
    assert steps[-1] - 1 in (accepted[-1], accepted[-1] + 1)


def test_greedy_verifier_steps_walk_from_the_first_anchor():
    from dflash2_tools.training.loss import greedy_verifier_steps

    assert greedy_verifier_steps([3, 9, 9, 1, 2, 9, 1]) == [3, 1, 2, 1]  # anchors 0, 3, 4, 6
    assert greedy_verifier_steps([1] * 4) == [1, 1, 1, 1] and greedy_verifier_steps([]) == []
