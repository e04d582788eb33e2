"""Token trees: several paths through the drafter's top-K lattice, verified in ONE target forward.

From the anchor, best-first: a child's log-probability is its parent's plus log softmax_b S_t(parent, b) over the
top-K (``selector_dflash2.lattice_table``); the ``budget`` most probable nodes, plus copied continuations as
branches. Each node sees the cache and its ancestors (``tree_attention_mask``) at the anchor's position plus its
depth. A chain (one path) is a tree with one child per node: the loop runs every step through these helpers.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import DynamicLayer, StaticLayer


@dataclass
class TokenTree:
    """Node 0 is the root (the last committed token); parents precede their children."""

    tokens: list[int]
    parents: list[int]  # -1 for the root
    depths: list[int]
    children: list[list[int]]  # per node, in the order they were added (best first)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.children.append([])
        self.children[parent].append(len(self.tokens) - 1)
        return len(self.tokens) - 1

    def child_with(self, node: int, token: int) -> int | None:
        return next((c for c in self.children[node] if self.tokens[c] == token), None)

    def prefixes(self) -> list[list[int]]:
        """Per node, the tree tokens from the root's child down to it (the root: []): what a logits processor sees
        after the committed sequence."""
        out = [[]]
        for i in range(1, len(self)):  # parents precede their children
            out.append(out[self.parents[i]] + [self.tokens[i]])
        return out

    def ancestor_mask(self, size: int | None = None) -> np.ndarray:
        """[size, size] bool (size: the nodes by default): node i sees node j iff j is i or one of its ancestors; a
        padding row past the nodes sees only itself. Built row from parent row (parents precede their children)."""
        size = len(self) if size is None else size
        mask = np.eye(size, dtype=bool)
        for i, parent in enumerate(self.parents[1:], start=1):
            mask[i] |= mask[parent]
        return mask


def root_tree(anchor: int) -> TokenTree:
    return TokenTree([anchor], [-1], [0], [[]])


def build_tree(anchor: int, candidates: list[list[int]], log_probs: list[list[list[float]]], budget: int, max_depth: int) -> TokenTree:
    """Best-first token tree under a node budget, on host data. ``candidates`` [n][K]; ``log_probs`` [n][K][K]:
    candidate k at position t after candidate j at t - 1 (t = 0: after the anchor). Children are distinct (top-K)."""
    tree = root_tree(anchor)
    depth_limit = min(max_depth, len(candidates))
    if budget <= 0 or depth_limit <= 0:
        return tree
    heap, tie, column = [], 0, {0: 0}  # column: node -> its candidate index at its position (the root: 0)

    def push_children(node: int, log_p: float):
        nonlocal tie
        t = tree.depths[node]  # children sit at draft position t (depth t + 1)
        if t >= depth_limit:
            return
        for k, lp in enumerate(log_probs[t][column[node]]):
            heapq.heappush(heap, (-(log_p + lp), tie, node, k))
            tie += 1

    push_children(0, 0.0)
    while heap and len(tree) - 1 < budget:
        neg, _, parent, k = heapq.heappop(heap)
        child = tree.add(candidates[tree.depths[parent]][k], parent)
        column[child] = k
        push_children(child, -neg)
    return depth_first(tree)


def depth_first(tree: TokenTree) -> TokenTree:
    """The same tree laid out depth-first, each node's children best first: the most probable path takes the first
    slots, so a step accepted along it already has its nodes leading the step's slots (``kept_first`` moves none)."""
    out = root_tree(tree.tokens[0])
    stack = [(child, 0) for child in reversed(tree.children[0])]
    while stack:
        node, parent = stack.pop()
        placed = out.add(tree.tokens[node], parent)
        stack.extend((child, placed) for child in reversed(tree.children[node]))
    return out


def add_branch(tree: TokenTree, tokens: list[int], room: int | None = None) -> TokenTree:
    """Merge a continuation of the root (e.g. the n-gram proposal) into the tree, sharing prefixes, adding at most
    ``room`` new nodes (the rest of the continuation is dropped)."""
    node, limit = 0, None if room is None else len(tree) + room
    for token in tokens:
        child = tree.child_with(node, token)
        if child is None and limit is not None and len(tree) >= limit:
            break
        node = child if child is not None else tree.add(token, node)
    return tree


def tree_with_branch(anchor: int, candidates: list[list[int]], log_probs: list[list[list[float]]], budget: int,
                     depth_limit: int, branch: int = 0, copies=None, max_nodes: int | None = None) -> TokenTree:
    """A step's tree: the ``budget`` most probable lattice nodes (at most ``depth_limit`` deep) plus up to ``branch``
    nodes of copied continuations (``copies(n)``: (prompt lookup's match or None, the suffix ``SuffixTrie`` or None);
    the trie's most frequent first); ``max_nodes`` bounds all together (a static cache's slots)."""
    branch = min(branch, depth_limit, max_nodes if max_nodes is not None else branch) if copies is not None else 0
    nodes = budget if max_nodes is None else max(0, min(budget, max_nodes - branch))
    tree = build_tree(anchor, candidates, log_probs, nodes, depth_limit)
    if branch <= 0:
        return tree
    match, trie = copies(branch)
    paths = (trie.branches(branch) if trie is not None else []) + ([match.tokens] if match is not None else [])
    limit = len(tree) + branch
    for path in paths:
        add_branch(tree, path, limit - len(tree))
    return tree


def tree_attention_mask(trees, past_mask: torch.Tensor, dtype, key_length: int | None = None, n_rows: int | None = None) -> torch.Tensor:
    """Additive 4D mask [b, 1, n_rows, key_length]: each row's context (``past_mask`` [b, past], holes 0) and each
    node's ancestors. ``key_length``: a static cache's slots (those after the tree masked); ``n_rows`` pads the
    forward (a padding row sees only itself, no real node sees it)."""
    trees = [trees] if isinstance(trees, TokenTree) else trees
    past_mask = past_mask.view(len(trees), -1)  # [b, past]
    past = past_mask.shape[1]
    rows = max(len(tree) for tree in trees) if n_rows is None else n_rows
    keys = past + rows if key_length is None else key_length
    device = past_mask.device
    real = torch.arange(rows, device=device) < torch.tensor([len(tree) for tree in trees], device=device)[:, None]  # [b, rows]
    pieces = [past_mask.bool()[:, None, :] & real[:, :, None],  # [b, rows, past] the context (padding rows: none)
              torch.from_numpy(np.stack([tree.ancestor_mask(rows) for tree in trees])).to(device)]  # [b, rows, rows]
    if keys > past + rows:
        pieces.append(real.new_zeros(len(trees), rows, keys - past - rows))  # stale static slots: masked
    allowed = torch.cat(pieces, dim=-1)  # [b, rows, keys]
    return torch.where(allowed, torch.zeros((), dtype=dtype, device=device), torch.finfo(dtype).min)[:, None]


def static_cache_length(cache) -> int | None:
    """Slots of a static cache (every layer attends over all of them), None for a dynamic one."""
    lengths = {layer.max_cache_len for layer in cache.layers if type(layer) is StaticLayer}
    return max(lengths) if lengths else None


# Tokens committed per step by a tree of N nodes over one path of the same drafter (docs/tree/acceptance_*.json:
# the mean ratio on ShareGPT-dev and HumanEval; larger trees not measured).
TREE_GAIN = {4: 1.07, 8: 1.18, 16: 1.28, 32: 1.36}


def tree_prior(drafter_acceptance: list[float], block_size: int, budget: int) -> float:
    """A tree step's expected drafted tokens before drafting: one path's (calibrated) times ``TREE_GAIN``; the rule's
    ``factor("tree")`` pulls it to what this call's trees commit."""
    gain = max((g for nodes, g in TREE_GAIN.items() if nodes <= budget), default=1.0)
    return (1.0 + sum(drafter_acceptance[: block_size - 1])) * gain - 1.0


def choose_tree_budget(costs, drafter_acceptance: list[float]) -> tuple[int, dict]:
    """(node budget, the values compared): the tree of N nodes committing the most tokens per unit of cost when it
    beats one path (``1 + sum_{i<L} a_i`` for ``verify(L) + draft``) and a plain step, else 0 (one path). No margin:
    one once kept the embedded target on paths that measured slower (docs/design.md)."""
    values = {"plain": 1.0}
    expected = 1.0
    for length, a in enumerate(drafter_acceptance, start=1):
        expected += a
        values[f"path-{length}"] = expected / (costs.verify(length) + costs.draft)
    one_path = max(values.values())
    trees = {f"tree-{nodes}": expected * gain / (costs.verify(nodes) + costs.draft) for nodes, gain in TREE_GAIN.items()}
    values.update(trees)
    best = max(trees, key=trees.get)
    return (int(best.split("-")[1]) if trees[best] > one_path else 0), values


def target_sliding_window(text_config) -> int | None:
    """The target's attention window if any layer attends through one (a tree mask here has no window)."""
    window = getattr(text_config, "sliding_window", None)
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types or "chunked_attention" in layer_types else None
    return window if getattr(text_config, "use_sliding_window", True) else None


def tree_support_problem(target, generation_config, cache=None) -> str | None:
    """Why tree verification cannot run exactly on this target and call (None: it can), decided before any forward."""
    if getattr(target, "_is_stateful", False):
        return ("a stateful target (linear attention) would scan all tree branches in one order; linear drafts with "
                "exact rollback serve it")
    window = target_sliding_window(target.config.get_text_config())
    if window is not None:
        return (f"the target attends through a {window}-token sliding window, which the tree mask does not apply; "
                "linear drafts serve it exactly")
    if generation_config.cache_implementation not in (None, "dynamic", "static") or (
        cache is not None and any(type(layer) not in (DynamicLayer, StaticLayer) for layer in getattr(cache, "layers", []))
    ):
        what = generation_config.cache_implementation or type(cache).__name__
        return (f"tree verification compacts a dynamic or static cache in place; a {what} cache is not supported: "
                "use cache_implementation=\"static\" or the default dynamic cache")
    return None


def refuse_unsupported(target, generation_config, cache=None) -> None:
    """Tree mode's limits, as clear errors (before the first forward)."""
    problem = tree_support_problem(target, generation_config, cache)
    if problem is not None:
        raise ValueError(f"tree verification (drafter.config.tree_budget) cannot run here: {problem}. "
                         "Set drafter.config.tree_budget = None (one path) for this call.")
