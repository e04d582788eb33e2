"""The drafter side of a training step: many blocks drafted in ONE forward, and the step's loss.

Block i at anchor a_i holds ``[tok[a_i], MASK, ..., MASK]``, sees the target features of tokens
< a_i and its own block only (``multi_block_training_mask``), exactly what it sees at inference.
Logits go through ``LossHead``: the rows the drafter drafts from (its draft vocabulary, or the
target's full head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import drafter as root
from .loss import (
    IGNORE,
    block_cross_entropy,
    block_inputs,
    chain_weights,
    column_map,
    distillation_cross_entropy,
    label_columns,
    position_weights,
    sample_anchors,
    selector_cross_entropy,
    teacher_at_blocks,
)



def multi_block_training_mask(
    anchor_positions: torch.Tensor, block_size: int, context_length: int, sliding_window: int | None = None, causal: bool = False
) -> torch.Tensor:
    """Training mask for many blocks of one sequence in a single forward.

    Keys are ``[context (context_length tokens at positions 0..); block_0; block_1; ...]``.
    Block b (anchor at position ``a_b``) sees context tokens at positions < a_b and its own
    block only, exactly what it would see at inference.

    anchor_positions [b, n_blocks] -> boolean mask [b, 1, n_blocks*block_size, context_length + n_blocks*block_size]
    """
    b, n_blocks = anchor_positions.shape
    device = anchor_positions.device
    k = torch.arange(block_size, device=device)
    query_pos = (anchor_positions[:, :, None] + k).reshape(b, -1)  # [b, n*B]
    query_block = torch.arange(n_blocks, device=device).repeat_interleave(block_size)  # [n*B]
    ctx_pos = torch.arange(context_length, device=device)  # [c]
    sees_ctx = ctx_pos[None, None, :] < anchor_positions.repeat_interleave(block_size, dim=1)[:, :, None]  # [b, n*B, c]
    if sliding_window is not None:
        sees_ctx = sees_ctx & (query_pos[:, :, None] - ctx_pos[None, None, :] < sliding_window)
    same_block = query_block[:, None] == query_block[None, :]  # [n*B, n*B]
    if causal:  # block position k sees block positions <= k
        same_block = same_block & (k.repeat(n_blocks)[:, None] >= k.repeat(n_blocks)[None, :])
    same_block = same_block.expand(b, -1, -1)  # [b, n*B, n*B]
    return torch.cat([sees_ctx, same_block], dim=-1)[:, None]  # [b, 1, n*B, c + n*B]

@dataclass
class LossHead:
    """The head logits are computed through, and how its columns map to token ids."""

    module: torch.nn.Module  # the target's LM head or a DraftVocabHead of its rows
    vocab_ids: torch.Tensor | None  # [V'] column -> token id (None: columns are token ids)
    columns: torch.Tensor | None  # [V] token id -> column or IGNORE
    logit_fn: object = None  # the drafter's draft_logits: (head, hidden) -> logits with the target's transforms

    @classmethod
    def of(cls, drafter, target, vocab: str = "draft") -> "LossHead":
        """``vocab="draft"``: the draft vocabulary's rows when the drafter has one; ``"full"``: the whole head."""
        lm_head = target.get_output_embeddings()
        ids = drafter.config.draft_vocab_ids if vocab == "draft" else None
        if ids is None:
            return cls(lm_head, None, None, drafter.draft_logits)
        module = root.modeling().DraftVocabHead(lm_head, ids)
        return cls(module, module.vocab_ids, column_map(drafter.config.vocab_size, ids, lm_head.weight.device), drafter.draft_logits)


def blocks_forward(drafter, target, head: LossHead, tokens, lengths, anchors, valid, features):
    """The blocks at ``anchors`` [b, n] in ONE drafter forward under the multi-block training mask.

    Returns (hidden [b, n, B-1, H], logits [b, n, B-1, V'], labels (token ids) [b, n, B-1], anchor ids [b, n]).
    """
    cfg = drafter.config
    B = cfg.block_size
    b, n_blocks = anchors.shape
    ids, labels = block_inputs(tokens.cpu(), lengths.cpu(), anchors.cpu(), valid.cpu(), B, cfg.mask_token_id)
    dev = tokens.device
    ids, labels, anchors = ids.to(dev), labels.to(dev), anchors.to(dev)
    T = tokens.shape[1]
    noise = drafter.embed_block(target.get_input_embeddings(), ids)  # [b, n*B, H]
    positions = torch.cat(
        [torch.arange(T, device=dev)[None].expand(b, -1), (anchors[:, :, None] + torch.arange(B, device=dev)).view(b, -1)], dim=1
    )  # [b, T + n*B]
    mask = multi_block_training_mask(anchors, B, T, cfg.sliding_window, cfg.is_causal)  # [b, 1, n*B, T + n*B]
    out = drafter(noise_embeds=noise, context_hidden_states=features.to(noise.dtype), position_ids=positions, attention_mask=mask)
    hidden = out.last_hidden_state.view(b, n_blocks, B, -1)[:, :, 1:]  # [b, n, B-1, H]
    logits = drafter.draft_logits(head.module, hidden)  # [b, n, B-1, V']
    anchor_ids = ids.view(b, n_blocks, B)[:, :, 0]  # [b, n]
    return hidden, logits, labels, anchor_ids


def compute_loss(drafter, target, head: LossHead, batch, features, generator, args, teacher=None, sum_over_ranks=None):
    """Loss of ``args.blocks_per_seq`` random-anchor blocks per sequence -> (loss, metrics).

    generator: one, or one per sequence; teacher: (log-probs [b, T, k], columns [b, T, k]) per token, or None (no
    distillation); sum_over_ranks: sums a weight over every rank's batch (several processes, training/ranks.py).
    """
    tokens, lengths, prompt_lengths = batch
    anchors, valid = sample_anchors(lengths, prompt_lengths, args.blocks_per_seq, generator)
    hidden, logits, labels, anchor_ids = blocks_forward(drafter, target, head, tokens, lengths, anchors, valid, features)
    B = drafter.config.block_size
    decay = position_weights(B, args.gamma, device=logits.device)
    cols = label_columns(labels, head.columns)  # [b, n, B-1]
    weights = chain_weights(logits, cols, decay, args.chain_floor) if args.position_weighting == "chain" else decay
    loss = block_cross_entropy(logits, cols, weights, sum_over_ranks)
    metrics = {"ce": float(loss.detach())}
    if teacher is not None and args.distill_weight > 0:
        anchors = anchors.to(logits.device)
        logp, tcols = (teacher_at_blocks(t.to(logits.device), anchors, B) for t in teacher)  # [b, n, B-1, k] each
        kd = distillation_cross_entropy(logits, logp, tcols, labels != IGNORE, weights, sum_over_ranks)
        loss = loss + args.distill_weight * kd
        metrics["distill"] = float(kd.detach())
    if drafter.candidate_selector is not None and args.selector_weight > 0:
        sel, covered = selector_cross_entropy(drafter.candidate_selector, hidden, logits, anchor_ids, labels, weights, head.vocab_ids,
                                              sum_over_ranks)
        loss = loss + args.selector_weight * sel
        metrics.update(selector_ce=float(sel.detach()), topk_coverage=float(covered))
    return loss, metrics
