"""Stage 6, evaluate: how many tokens the drafter would get accepted, on held-out sequences.

Two figures (``OUT/log.jsonl``): blocks at random anchors (``acceptance_length_*``), and
on-policy (``on_policy_acceptance_length_*``): blocks at every response token, walked the way a
greedy verifier re-generating the response visits them (the next block starts right after the
last committed token). On the target's own greedy data in the precision it is served in, the
on-policy figure is what the plain ``generate(..., assistant_model=drafter)`` call measures
(tested step for step against generation). Random anchors read high: the anchors a verifier
visits follow rejected drafts, i.e. surprising tokens.
"""

from __future__ import annotations

import torch

from .batches import collate
from .features import target_forward
from .forward import LossHead, blocks_forward
from .loss import IGNORE, acceptance_lengths, greedy_verifier_steps, sample_anchors


def _token_ids(columns: torch.Tensor, head: LossHead) -> torch.Tensor:
    return columns if head.vocab_ids is None else head.vocab_ids[columns]


def block_acceptance(drafter, head: LossHead, hidden, logits, labels, anchor_ids) -> dict[str, torch.Tensor]:
    """Acceptance length of every block [b, n] under greedy verification: argmax drafts and, if the
    drafter has a selector, its walk through the top-K."""
    out = {"argmax": acceptance_lengths(_token_ids(logits.argmax(-1), head), labels)}
    if drafter.candidate_selector is not None:
        b, n = anchor_ids.shape
        walk = drafter.candidate_selector.walk(hidden.float().flatten(0, 1), logits.float().flatten(0, 1), anchor_ids.flatten(),
                                               vocab_ids=head.vocab_ids)
        out["selector"] = acceptance_lengths(walk.tokens.view(b, n, -1), labels)
    return out


@torch.no_grad()
def response_acceptance(drafter, target, head, tokens, lengths, prompt_len: int, features, autocast, chunk: int = 64):
    """Acceptance length of the block anchored at EVERY response token of one sequence ([1, T]), in
    forwards of ``chunk`` blocks -> {method: [n_response_anchors]}."""
    L = int(lengths[0])
    anchors_all = torch.arange(prompt_len, L - 1)  # the first block is drafted after the prefill's own token
    out = {}
    for start in range(0, len(anchors_all), chunk):
        anchors = anchors_all[start : start + chunk][None]  # [1, n]
        with autocast():
            hidden, logits, labels, anchor_ids = blocks_forward(drafter, target, head, tokens[:, :L], lengths, anchors,
                                                                torch.ones_like(anchors, dtype=torch.bool), features[:, :L])
        for method, acc in block_acceptance(drafter, head, hidden, logits.float(), labels, anchor_ids).items():
            out.setdefault(method, []).append(acc[0].cpu())
    return {method: torch.cat(parts) for method, parts in out.items()}


@torch.no_grad()
def evaluate(drafter, target, head: LossHead, dev, args, device, autocast):
    """Per-position top-1 / top-K recall and acceptance length (argmax and selector walk), at random
    anchors and on-policy, over the first ``args.eval_sequences`` dev sequences."""
    drafter.eval()
    B = drafter.config.block_size
    K = drafter.config.selector_top_k or 16
    gen = torch.Generator().manual_seed(12345)
    top1, topk, count = torch.zeros(B - 1), torch.zeros(B - 1), torch.zeros(B - 1)
    uniform = {"argmax": [], "selector": []}  # acceptance of blocks at random anchors
    on_policy = {"argmax": [0, 0], "selector": [0, 0]}  # [tokens committed, target forwards]
    cfg = drafter.config
    for start in range(0, min(len(dev), args.eval_sequences), args.batch_size):
        tokens, lengths, prompt_lengths = (x.to(device) for x in collate(dev[start : start + args.batch_size], args.pad_id))
        with autocast():
            feats, _, _ = target_forward(target, tokens, lengths, cfg.target_layer_ids, cfg.target_hidden_reduction)
            anchors, valid = sample_anchors(lengths.cpu(), prompt_lengths.cpu(), args.blocks_per_seq, gen)
            hidden, logits, labels, anchor_ids = blocks_forward(drafter, target, head, tokens, lengths.cpu(), anchors, valid, feats)
        logits = logits.float()
        valid = labels != IGNORE
        top = _token_ids(logits.topk(K, dim=-1).indices, head)  # [b, n, B-1, K] token ids
        top1 += ((top[..., 0] == labels) & valid).sum((0, 1)).float().cpu()
        topk += ((top == labels[..., None]).any(-1) & valid).sum((0, 1)).float().cpu()
        count += valid.sum((0, 1)).float().cpu()
        blocks = valid[..., 0]  # blocks with at least one label
        for method, acc in block_acceptance(drafter, head, hidden, logits, labels, anchor_ids).items():
            uniform[method].append(acc[blocks].float().cpu())
        for row in range(tokens.shape[0]):  # the anchors a greedy verifier would visit, one sequence at a time
            for method, acc in response_acceptance(drafter, target, head, tokens[row : row + 1], lengths[row : row + 1].cpu(),
                                                   int(prompt_lengths[row]), feats[row : row + 1], autocast).items():
                steps = greedy_verifier_steps(acc.tolist())
                on_policy[method][0] += sum(steps)
                on_policy[method][1] += len(steps)
    drafter.train()
    result = {
        "top1_per_position": (top1 / count.clamp(min=1)).tolist(),
        "topk_per_position": (topk / count.clamp(min=1)).tolist(),
    }
    for method in uniform:  # argmax always (NaN without dev data), the selector where the drafter has one
        if uniform[method] or method == "argmax":
            result[f"acceptance_length_{method}"] = float(torch.cat(uniform[method]).mean()) if uniform[method] else float("nan")
            committed, forwards = on_policy[method]
            result[f"on_policy_acceptance_length_{method}"] = committed / forwards if forwards else float("nan")
    return result
