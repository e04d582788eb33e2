"""Stage 5, loss: the training objective of a DFlash 2 drafter (SPEC section 2c), as pure functions.

Many blocks per sequence are trained in ONE drafter forward: block b starts at a random
anchor a_b (a response token), holds ``[tok[a_b], MASK, ..., MASK]`` and predicts
``tok[a_b + 1 .. a_b + B - 1]``; it sees the target features of tokens < a_b and its own
block only (``multi_block_training_mask``), exactly what it sees at inference.

    loss = sum_k w_k CE(draft_logits_k, tok[a + k]) / sum_k w_k          w_k = exp(-(k-1)/gamma)
         + distill_weight * sum_k w_k H(p_target(. | tok[<a+k]), q_k) / sum_k w_k   (teacher top-k)
         + selector_weight * CE(S_k(tok[a + k - 1], top-K_k), tok[a + k])   (only where tok[a+k] is in the top-K)

Logits cover the drafter's vocabulary: the draft vocabulary's columns when it has one (the
rows the drafter drafts from at inference; the full 49,152-row head made the loss ~10x dearer),
so labels are mapped to columns first (``label_columns``; a token outside the draft vocabulary
cannot be drafted and is left out of the CE). With ``chain`` weighting, w_k also carries the
drafter's own detached probability of having drafted tok[a+1..a+k-1] right, the chance that
position k is ever verified (an acceptance-tracking weight in the spirit of first-error /
dynamic position weights), floored so that no position is dropped.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

IGNORE = -100
DEFAULT_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}


def position_weights(block_size: int, gamma: float | None = None, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for block positions k = 1..B-1 -> [B-1]."""
    if gamma is None:
        gamma = DEFAULT_GAMMA.get(block_size, max(block_size / 2.0, 1.0))
    k = torch.arange(1, block_size, dtype=torch.float32, device=device)
    return torch.exp(-(k - 1) / gamma)


def sample_anchors(
    lengths: torch.Tensor, prompt_lengths: torch.Tensor, n_blocks: int, generator: torch.Generator | list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random anchors from response tokens: a in [prompt_len - 1, len - 2] (the block must predict >= 1 token).

    The anchor may be the last prompt token: its block predicts the first response tokens.
    Returns anchors [b, n_blocks] (distinct where possible) and valid [b, n_blocks] (False = padding block).
    """
    b = lengths.shape[0]
    generators = generator if isinstance(generator, (list, tuple)) else [generator] * b  # one per sequence, or shared
    anchors = torch.zeros(b, n_blocks, dtype=torch.long)
    valid = torch.zeros(b, n_blocks, dtype=torch.bool)
    for i in range(b):
        lo = max(int(prompt_lengths[i]) - 1, 0)
        hi = int(lengths[i]) - 2  # inclusive
        if hi < lo:
            continue
        span = hi - lo + 1
        pick = torch.randperm(span, generator=generators[i])[:n_blocks] + lo
        anchors[i, : len(pick)] = pick.sort().values
        valid[i, : len(pick)] = True
    return anchors, valid


def block_inputs(
    tokens: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, block_size: int, mask_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block input ids [b, n*B] (anchor then MASKs) and labels [b, n, B-1] (IGNORE past the end / padding blocks)."""
    b, n = anchors.shape
    k = torch.arange(block_size)
    pos = anchors[:, :, None] + k  # [b, n, B]
    in_range = (pos < lengths[:, None, None]) & valid[:, :, None]  # [b, n, B]
    gathered = tokens.gather(1, pos.clamp(max=tokens.shape[1] - 1).view(b, -1)).view(b, n, block_size)  # [b, n, B]
    labels = torch.where(in_range, gathered, torch.full_like(gathered, IGNORE))[:, :, 1:]  # [b, n, B-1]
    ids = torch.full_like(gathered, mask_token_id)
    ids[:, :, 0] = gathered[:, :, 0]
    return ids.view(b, n * block_size), labels


def column_map(vocab_size: int, vocab_ids: list[int] | None, device=None) -> torch.Tensor | None:
    """[V] token id -> column of the draft vocabulary (IGNORE outside it); None without a draft vocabulary."""
    if vocab_ids is None:
        return None
    out = torch.full((vocab_size,), IGNORE, dtype=torch.long, device=device)
    out[torch.as_tensor(vocab_ids, device=device)] = torch.arange(len(vocab_ids), device=device)
    return out


def label_columns(labels: torch.Tensor, columns: torch.Tensor | None) -> torch.Tensor:
    """Token-id labels -> logit columns (identity without a draft vocabulary); IGNORE stays IGNORE."""
    if columns is None:
        return labels
    return torch.where(labels == IGNORE, labels, columns[labels.clamp(min=0)])


def weighted_mean(values: torch.Tensor, w: torch.Tensor, sum_over_ranks=None) -> torch.Tensor:
    """sum(values * w) / sum(w); with ``sum_over_ranks`` the denominator is the weight of every rank's batch, so the
    ranks' terms add up to the global batch's mean (training/ranks.py)."""
    total = w.sum() if sum_over_ranks is None else sum_over_ranks(w.sum())
    return (values * w).sum() / total.clamp(min=1e-8)


def block_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, sum_over_ranks=None) -> torch.Tensor:
    """logits [b, n, B-1, V], labels (columns) [b, n, B-1], weights [B-1] or [b, n, B-1] -> weighted mean CE."""
    ce = F.cross_entropy(logits.flatten(0, 2).float(), labels.flatten(), ignore_index=IGNORE, reduction="none")
    ce = ce.view(labels.shape)  # [b, n, B-1]
    w = _weights(weights, labels) * (labels != IGNORE)  # [b, n, B-1]
    return weighted_mean(ce, w, sum_over_ranks)


def _weights(weights: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return weights.to(like.device).expand(like.shape) if weights.dim() == 1 else weights.to(like.device)


def teacher_at_blocks(teacher: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per-token teacher rows [b, T, k] -> rows predicting each block label [b, n, B-1, k].

    Block position k (1..B-1) predicts tok[a + k]: the target's distribution at position a + k - 1.
    """
    b, T, k = teacher.shape
    n = anchors.shape[1]
    pos = (anchors[:, :, None] + torch.arange(block_size - 1, device=anchors.device)).clamp(max=T - 1)  # [b, n, B-1]
    return teacher.gather(1, pos.view(b, -1, 1).expand(-1, -1, k)).view(b, n, block_size - 1, k)  # [b, n, B-1, k]


def distillation_cross_entropy(logits, teacher_logp, teacher_cols, valid, weights, sum_over_ranks=None) -> torch.Tensor:
    """H(p, q) of the drafter's q against the target's top-k p (renormalised over the k), weighted mean.

    logits [b, n, B-1, V]; teacher_logp / teacher_cols [b, n, B-1, k]; valid [b, n, B-1] bool.
    """
    p = torch.softmax(teacher_logp.float(), dim=-1)  # [b, n, B-1, k]
    log_q = torch.log_softmax(logits.float(), dim=-1).gather(-1, teacher_cols)  # [b, n, B-1, k]
    ce = -(p * log_q).sum(-1)  # [b, n, B-1]
    w = _weights(weights, ce) * valid
    return weighted_mean(ce, w, sum_over_ranks)


def chain_weights(logits: torch.Tensor, labels: torch.Tensor, decay: torch.Tensor, floor: float) -> torch.Tensor:
    """Acceptance-tracking weights [b, n, B-1]: decay_k * max(prod_{j<k} q_j(tok[a+j]), floor), detached.

    labels are columns; a position after an undraftable (IGNORE) label gets the floor.
    """
    with torch.no_grad():
        log_q = torch.log_softmax(logits.detach().float(), dim=-1)
        hit = log_q.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1).exp() * (labels != IGNORE)  # [b, n, B-1]
        survive = torch.cat([torch.ones_like(hit[..., :1]), hit[..., :-1].cumprod(-1)], dim=-1)  # [b, n, B-1]
        return decay.to(hit.device) * survive.clamp(min=floor)


def selector_cross_entropy(
    selector, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
    vocab_ids: torch.Tensor | None = None, sum_over_ranks=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Selector term: S_k over the top-K with the predecessor teacher-forced to the true token.

    hidden [b, n, B-1, H], logits [b, n, B-1, V], anchor_ids [b, n], labels (token ids) [b, n, B-1];
    vocab_ids [V] maps logit columns to token ids when the logits cover a draft vocabulary.
    Positions whose true token is outside the top-K are skipped. Returns (loss, fraction in top-K).
    """
    top_values, top_ids = logits.detach().float().topk(selector.top_k, dim=-1)  # [b, n, B-1, K]
    if vocab_ids is not None:
        top_ids = vocab_ids[top_ids]  # [b, n, B-1, K] columns -> token ids
    predecessors = torch.cat([anchor_ids[:, :, None], labels[:, :, :-1]], dim=-1).clamp(min=0)  # [b, n, B-1]
    gated = selector.hidden_projection(hidden).float()  # [b, n, B-1, R]
    scores = selector.scores(gated, top_values, top_ids, predecessors)  # [b, n, B-1, K]
    hit = top_ids == labels[..., None]  # [b, n, B-1, K]
    in_top = hit.any(-1) & (labels != IGNORE)  # [b, n, B-1]
    target = hit.float().argmax(-1)  # [b, n, B-1]
    ce = F.cross_entropy(scores.flatten(0, 2), target.flatten(), reduction="none").view(labels.shape)
    w = _weights(weights, ce) * in_top
    covered = in_top.sum() / (labels != IGNORE).sum().clamp(min=1)
    return weighted_mean(ce, w, sum_over_ranks), covered


def acceptance_lengths(draft_tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """1 + number of leading drafted tokens equal to the labels, per block: [b, n, B-1] -> [b, n].

    With labels = the target's own greedy continuation this is exactly the tokens one
    target forward would commit for that block (greedy verification).
    """
    match = (draft_tokens == labels) & (labels != IGNORE)
    return 1 + match.long().cumprod(dim=-1).sum(-1)


def expected_acceptance_from_rates(per_position: list[float]) -> float:
    """1 + sum_k P(first k drafts all accepted), from conditional per-position rates."""
    total, run = 1.0, 1.0
    for rate in per_position:
        run *= rate
        total += run
    return total if math.isfinite(total) else float("nan")


def greedy_verifier_steps(acceptance_at) -> list[int]:
    """Tokens committed per target forward when greedy decoding re-generates a response itself.

    ``acceptance_at[a]`` = acceptance length (1 + accepted drafts) of the block anchored at the
    a-th response token. A greedy verifier anchors its first block at the first response token,
    commits ``acceptance_at[a]`` tokens and anchors the next block right after them, so it visits
    only the anchors this walk visits. An average over uniform anchors is biased upward against
    it: the anchors right after a rejected draft are the surprising tokens.
    """
    steps, a = [], 0
    while a < len(acceptance_at):
        steps.append(int(acceptance_at[a]))
        a += steps[-1]
    return steps
