"""Speculative sampling keeps the target's distribution exactly.

The exact joint distribution of the first three generated tokens is computed from the
target (after its logits processors); many seeded speculative samples are compared with it
by a chi-square goodness-of-fit test. A verifier that ignores the selector's proposal q
(treating every draft as if q(draft) = 1) is shown to FAIL the same test.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import FREE_COSTS, root, tiny_drafter, tiny_target
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopPLogitsWarper

V = 5
N_NEW = 3
SAMPLES = 800


def _processors(temperature, top_p, repetition_penalty):
    procs = LogitsProcessorList()
    if repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
    procs.append(TemperatureLogitsWarper(temperature))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    return procs


@torch.no_grad()
def exact_joint(target, prompt, procs) -> dict[tuple, float]:
    out = {}
    for seq in itertools.product(range(V), repeat=N_NEW):
        p, ids = 1.0, prompt.clone()
        for tok in seq:
            logits = target(ids).logits[:, -1].float()
            probs = procs(ids, logits).softmax(-1)[0]
            p *= float(probs[tok])
            ids = torch.cat([ids, torch.tensor([[tok]])], 1)
            if p == 0:
                break
        out[seq] = p
    return out


def chi_square_p_value(counts: dict, expected: dict, n: int) -> float:
    """Pearson chi-square, cells with expected count < 5 pooled into one."""
    stat, dof, pooled_obs, pooled_exp = 0.0, -1, 0.0, 0.0
    for cell, p in expected.items():
        e, o = p * n, counts.get(cell, 0)
        if e < 5:
            pooled_obs += o
            pooled_exp += e
            continue
        stat += (o - e) ** 2 / e
        dof += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9)
        dof += 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), torch.tensor(stat / 2.0, dtype=torch.float64)))


def _sample_counts(target, drafter, prompt, gen_kw, n):
    counts = {}
    for seed in range(n):
        torch.manual_seed(seed)
        out = target.generate(prompt, assistant_model=drafter, do_sample=True, max_new_tokens=N_NEW, **gen_kw)
        cell = tuple(out[0, prompt.shape[1] :].tolist())
        counts[cell] = counts.get(cell, 0) + 1
    return counts


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("llama", vocab=V, hidden=48, layers=3, seed=5)
    with torch.no_grad():  # a flatter target than the greedy tests' one, so many cells have mass
        target.get_output_embeddings().weight.mul_(0.35)
    target.generation_config.eos_token_id = None
    drafter = tiny_drafter(target, seed=7, mask_token_id=V - 1, selector_top_k=3, block_size=4, conv_group_size=16)
    with torch.no_grad():  # a proposal far from the target: q != p, so the test has power
        drafter.candidate_selector.hidden_projection.weight.normal_(0, 2.0)
    prompt = torch.tensor([[1, 3, 2]])
    return target, drafter, prompt


@pytest.mark.parametrize(
    "temperature, top_p, repetition_penalty, draft_tokens, draft_vocab, hybrid",
    [
        (1.0, 1.0, 1.0, None, None, None),
        (0.7, 0.9, 1.3, None, None, None),
        (1.0, 1.0, 1.0, 1, None, None),
        (1.0, 1.0, 1.0, None, [0, 1, 3, 4], None),
        (1.0, 1.0, 1.0, None, None, {"ngram_margin": 100.0, "costs": FREE_COSTS}),
        (0.7, 0.9, 1.3, None, None, {"ngram_margin": 100.0, "min_n": 1, "max_n": 1, "costs": FREE_COSTS}),
    ],
    ids=["plain", "processors", "one-token-drafts", "draft-vocabulary", "hybrid-ngram", "hybrid-ngram-processors"],
)
def test_speculative_sampling_matches_target_distribution(setup, monkeypatch, temperature, top_p, repetition_penalty, draft_tokens, draft_vocab, hybrid):
    target, drafter, prompt = setup
    if draft_vocab is not None:  # token 2 is never proposed (q = 0): the residual must carry its mass
        monkeypatch.setattr(drafter.config, "draft_vocab_ids", draft_vocab)
    if hybrid is not None:  # the n-gram continuation wins whenever there is a match (q = its point mass)
        monkeypatch.setattr(drafter.config, "hybrid_ngram", hybrid)
    gen_kw = dict(temperature=temperature, top_p=top_p, top_k=0, repetition_penalty=repetition_penalty, pad_token_id=0)
    if draft_tokens is not None:  # num_assistant_tokens: only the first drafted tokens are verified
        gen_kw["num_assistant_tokens"] = draft_tokens
    expected = exact_joint(target, prompt, _processors(temperature, top_p, repetition_penalty))
    assert abs(sum(expected.values()) - 1) < 1e-4
    with root.generation().collect_stats() as runs:
        counts = _sample_counts(target, drafter, prompt, gen_kw, SAMPLES)
    drafted = sum(r.drafted for r in runs)
    assert drafted > 0  # the draft/verify path ran
    if hybrid is not None:  # both proposers really ran
        assert all(sum(r.per_proposer.get(p, {}).get("steps", 0) for r in runs) > 0 for p in ("ngram", "dflash2"))
    assert chi_square_p_value(counts, expected, SAMPLES) > 1e-3


def test_a_verifier_that_ignores_q_fails(setup, monkeypatch):
    """Evidence that the test above has power: drop q from the verifier and the same test rejects."""
    target, drafter, prompt = setup
    def ignores_q(p, children, q, generator=None):
        # accept a draft with probability p(draft), else resample from p: the proposal q is never used
        keep = torch.rand(children.shape, generator=generator) < p.gather(1, children[:, None])[:, 0]
        return torch.where(keep, children, torch.multinomial(p, 1, generator=generator)[:, 0])

    monkeypatch.setattr(root.accept(), "_draws_against_q", ignores_q)  # the loop's rule for a token sampled from q
    gen_kw = dict(temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0)
    expected = exact_joint(target, prompt, _processors(1.0, 1.0, 1.0))
    counts = _sample_counts(target, drafter, prompt, gen_kw, SAMPLES)
    assert chi_square_p_value(counts, expected, SAMPLES) < 1e-3
