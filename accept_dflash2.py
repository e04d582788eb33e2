"""Acceptance: the target's choice after every verified node in ONE host transfer, then a walk on the host.

After a verification forward over a token tree (``tree_dflash2.TokenTree``; a chain is a tree with one child per node):

    1. process: the logits processors see each node's own prefix after the row's committed sequence
       (``process_tree``)
    2. choose, on the device, for EVERY node at once: greedy x_i = argmax p_i; sampling x_i ~ p_i; a node whose one
       child c was SAMPLED from a known q (a chain drafted at temperature > 0) takes the speculative-sampling rule:
       x_i = c w.p. min(1, p_i(c) / q_i(c)), else x_i ~ norm(max(p_i - q_i, 0))
    3. move the choices to the host in one transfer, and walk from the root: a child equal to x_i continues the walk;
       otherwise x_i is the bonus token and the step ends

Why drawing at every node at once is exact: the walk reads node i's draw only when it reaches node i, and the draws
are independent, so the path it takes has the law of drawing one token after another from the target (x ~ p given
the path so far; the min(1, p/q) rule is the classic one, exact for a child drawn from q). Nodes the walk does not
reach cost a draw that is thrown away -- compute, not a device sync.
"""

from __future__ import annotations

import torch


def as_row(fn, ids: list[int], row: int, rows: int, device, scores: torch.Tensor | None = None):
    """``fn(input_ids, scores)`` (a logits-processor or stopping-criteria list) for ONE row of the caller's batch.

    Processors may hold per-row state sized for the caller's batch (``prompt_ignore_length``, per-row prefixes), and
    rows here have different lengths, so the call gets a full-size batch whose every row is this row's sequence,
    and answers with row ``row``: what transformers' loop would compute for that row at that length."""
    batch_ids = torch.tensor([ids], device=device).expand(rows, -1)  # [rows, T]
    if scores is None:
        return fn(batch_ids, None)[row]
    return fn(batch_ids, scores[None].expand(rows, -1).clone())[row]  # [V]


def process_tree(logits: torch.Tensor, tree, prefix: list[int], row: int, rows: int, logits_processor) -> torch.Tensor:
    """Processed logits [N, V] of one row's tree (``logits`` [N, V], fp32): node k's processors see the row's sequence
    ``prefix`` followed by the tree tokens from the root's child down to node k.

    A call of one row (``rows == 1``) processes the nodes of one depth together (they share a length: calls per step
    <= the tree's depth); in a batch each node goes through ``as_row``, since processors may keep per-row state."""
    if not len(logits_processor):
        return logits
    prefixes = tree.prefixes()
    if rows > 1:
        return torch.stack([as_row(logits_processor, prefix + path, row, rows, logits.device, logits[k])
                            for k, path in enumerate(prefixes)])  # [N, V]
    out = torch.empty_like(logits)
    by_depth: dict[int, list[int]] = {}
    for i, depth in enumerate(tree.depths):
        by_depth.setdefault(depth, []).append(i)
    for depth, nodes in by_depth.items():
        ids = torch.tensor([prefix + prefixes[i] for i in nodes], device=logits.device)  # [n_d, T + depth]
        index = torch.tensor(nodes, device=logits.device)
        out[index] = logits_processor(ids, logits[index].clone())  # [n_d, V]
    return out


def first_argmax(logits: torch.Tensor, block: int = 256) -> torch.Tensor:
    """[...] the first index of each row's maximum over [..., V], as ``argmax``, found from per-block maxima: one
    ``amax`` pass, then ``argmax`` inside the winning block (on a CPU 2x faster than ``torch.max`` over [4, 17, 49152])."""
    V = logits.shape[-1]
    n = V // block
    if n < 4:
        return logits.argmax(-1)
    block_max = logits[..., : n * block].unflatten(-1, (n, block)).amax(-1)  # [..., n]
    if V % block:
        block_max = torch.cat([block_max, logits[..., n * block:].amax(-1, keepdim=True)], -1)  # [..., n + 1]
    index = block_max.argmax(-1, keepdim=True) * block + torch.arange(block, device=logits.device)  # [..., block]
    index = index.clamp_max(V - 1)  # the short last block repeats V - 1, which the first maximum never passes
    return index.gather(-1, logits.gather(-1, index).argmax(-1, keepdim=True))[..., 0]


def target_choices(tree, logits: torch.Tensor, do_sample: bool, log_q: torch.Tensor | None = None,
                   generator=None) -> torch.Tensor:
    """[N] (on the device) the target's token after each node, from its processed logits [N, V].

    ``log_q`` [L, V]: node i < L has ONE child, sampled from q_i (a chain drafted at temperature > 0)."""
    if not do_sample:
        return first_argmax(logits)  # [N]
    probs = torch.softmax(logits.float(), dim=-1)  # [N, V]
    choices = torch.multinomial(probs, 1, generator=generator)[:, 0]  # [N]: x_i ~ p_i
    if log_q is not None and len(log_q):
        L = log_q.shape[0]
        children = torch.tensor([tree.tokens[tree.children[i][0]] for i in range(L)], device=logits.device)  # [L]
        q = torch.softmax(log_q.float(), dim=-1).to(logits.device)  # [L, V]
        choices[:L] = _draws_against_q(probs[:L], children, q, generator)
    return choices


def _draws_against_q(p: torch.Tensor, children: torch.Tensor, q: torch.Tensor, generator=None) -> torch.Tensor:
    """[L] speculative sampling per row: keep child c_i w.p. min(1, p_i(c_i) / q_i(c_i)), else x ~ norm(max(p_i - q_i, 0)).
    p, q: [L, V]; children: [L]."""
    p_c = p.gather(1, children[:, None])[:, 0]  # [L]
    q_c = q.gather(1, children[:, None])[:, 0]  # [L]
    keep = torch.rand(p_c.shape, generator=generator, device=p.device) * q_c < p_c  # [L]
    residual = (p - q).clamp_min(0)  # [L, V]
    empty = residual.sum(-1) <= 0  # p == q: rejection had probability 0
    residual = torch.where(empty[:, None], p, residual)  # any valid row: its draw is never used
    redraw = torch.multinomial(residual, 1, generator=generator)[:, 0]  # [L]
    return torch.where(keep | empty, children, redraw)


def accepted_path(tree, choices: list[int]) -> tuple[list[int], int]:
    """(accepted path as node ids from the root, bonus token), from the target's choice after each node (host)."""
    path, node = [0], 0
    while True:
        child = tree.child_with(node, choices[node])
        if child is None:
            return path, choices[node]
        path.append(child)
        node = child
