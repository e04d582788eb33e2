"""Tree verification: several paths through the drafter's top-K lattice, verified in ONE target forward.

One step (batch size 1), after the prefill:

    1. draft: one drafter forward from the anchor (the last committed token) gives, at every
       block position t, the top-K candidates and the selector's scores S_t(a, b)
    2. tree: best-first from the anchor; a child's log-probability is its parent's plus
       log softmax_b S_t(parent token, b) over the top-K; the ``budget`` most probable nodes are
       kept, and the n-gram continuation (hybrid drafting) joins as one more branch
    3. verify: one target forward over the nodes; each node sees the cache and its own
       ancestors (tree mask), its position is the anchor's plus its depth
    4. accept, walking from the root: draw the target's next token x ~ p (processed logits) by
       checking the node's children first: child c is x with probability p'(c) = p(c) / (mass
       left), else p'(c) <- 0 and the next child is checked; if none is x, x ~ p' (what is left).
       That IS a draw from p (exact for any candidate set); greedy takes x = argmax p. A child
       equal to x continues the walk; otherwise x is the bonus token and the step ends
    5. commit: the cache keeps the K/V of the accepted path only, in order; the accepted
       nodes' hidden states are the drafter's next context features

transformers' assisted loop verifies one path, so tree mode runs this loop in place of
``_assisted_decoding`` (``install_assisted_generation_hook``), with the logits processors, stopping
criteria, streamer, max_length and EOS handling that loop gets from ``generate``. The same loop runs one
path per step (``budget`` 0: the hybrid rule's proposal as a one-branch tree, ``path_proposal``) where
the assisted loop cannot: on a static cache.
"""

from __future__ import annotations

import contextlib
import heapq
import time
from dataclasses import dataclass

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

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: node i sees node j iff j is i or one of its ancestors."""
        n = len(self)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            if self.parents[i] >= 0:
                mask[i] = mask[self.parents[i]]
            mask[i, i] = True
        return mask


def root_tree(anchor: int) -> TokenTree:
    return TokenTree([anchor], [-1], [0], [[]])


def build_tree(anchor: int, candidates: list[list[int]], log_probs: list[list[list[float]]], budget: int, max_depth: int) -> TokenTree:
    """Best-first token tree under a node budget, on host data (no device sync while it grows).

    candidates: [n][K] token ids per draft position; log_probs: [n][K][K] with ``log_probs[t][j][k]`` the log-prob of
    candidate k at position t after candidate j of position t - 1 (row t = 0: after the anchor, every j alike).
    Children of one node are distinct (the top-K are), so the tree has no duplicate paths.
    """
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
    return tree


def add_branch(tree: TokenTree, tokens: list[int]) -> TokenTree:
    """Merge a continuation of the root (e.g. the n-gram proposal) into the tree, sharing prefixes."""
    node = 0
    for token in tokens:
        child = tree.child_with(node, token)
        node = child if child is not None else tree.add(token, node)
    return tree


def lattice_log_probs(drafter, hidden: torch.Tensor, logits: torch.Tensor, vocab_ids: torch.Tensor | None, anchor: int):
    """(candidates [n][K], log_probs [n][K][K]) of one block's top-K lattice, scored at once and moved to the host in
    ONE transfer (the tree then grows on the host).

    hidden [n, H], logits [n, V'] at the drafted positions. With a selector, ``log_probs[t][j]`` is log softmax
    S_t(candidate j of position t - 1, .) over the top-K (the anchor for t = 0); without one, the log softmax of
    the draft logits over the top-K, whatever the parent.
    """
    selector = drafter.candidate_selector
    k = selector.top_k if selector is not None else min(8, logits.shape[-1])
    top_values, top_cols = logits.float().topk(k, dim=-1)  # [n, K]
    candidates = top_cols if vocab_ids is None else vocab_ids[top_cols]  # [n, K] token ids
    n = candidates.shape[0]
    if selector is None:
        table = torch.log_softmax(top_values, dim=-1)[:, None, :].expand(n, k, k)  # [n, K, K]
    else:
        gated = selector.hidden_projection(hidden).float()  # [n, R]
        parents = torch.cat([candidates.new_full((1, k), anchor), candidates[:-1]])  # [n, K]: position t's possible parents
        pred = selector.predecessor_codebook[parents].float() * gated[:, None, :]  # [n, K parent, R]
        succ = selector.successor_codebook[candidates].float()  # [n, K child, R]
        scores = top_values[:, None, :] + torch.einsum("njr,nkr->njk", pred, succ)  # [n, K parent, K child]
        table = torch.log_softmax(scores, dim=-1)
    host = torch.cat([candidates.to(table.dtype)[:, None, :], table], dim=1).cpu()  # [n, 1 + K, K]: one transfer
    return host[:, 0].long().tolist(), host[:, 1:].tolist()


def path_proposal(gen, input_ids: torch.Tensor, attention_mask: torch.Tensor, limit: int):
    """One path for this step, as the linear loop picks it: the n-gram continuation, the block draft (run only when
    the rule says it is worth its forward) or nothing, cut to what pays (``ngram_dflash2.HybridRule``).
    Returns (the rule's choice, its per-token rates, the tokens to verify)."""
    match = None
    if gen.ngram is not None:
        gen.ngram.extend(input_ids[0, len(gen.ngram.ids):].tolist())  # only the newly committed tokens
        match = gen.ngram.lookup(min(gen.ngram_tokens, limit))
    n_draft = min(gen.draft_limit, limit)
    confidences, drafted = None, []
    if n_draft > 0 and (gen.ngram is None or gen.rule.run_drafter(match, n_draft)):
        draft = gen.draft_path(input_ids, attention_mask, n_draft)
        host = torch.cat([draft.tokens[0].float(), draft.confidence[0].float()]).tolist()  # one transfer
        drafted, confidences = [int(t) for t in host[:n_draft]], host[n_draft:]
    choice = gen.rule.choose(match, confidences)
    if choice.proposer == "ngram":
        return choice, gen.rule.ngram_rates(match), match.tokens[: choice.length]
    rates = gen.rule.drafter_rates(confidences) if confidences is not None else []
    return choice, rates, drafted[: choice.length]


def tree_attention_mask(tree: TokenTree, past_mask: torch.Tensor, dtype, key_length: int | None = None) -> torch.Tensor:
    """Additive 4D mask [1, 1, N, key_length]: the committed context (its own padding mask) and ancestors.

    ``key_length`` (default past + N): a static cache attends over all its slots; those after the tree are masked."""
    allowed = torch.cat([past_mask.bool()[None].expand(len(tree), -1), tree.ancestor_mask().to(past_mask.device)], dim=1)  # [N, past + N]
    if key_length is not None and key_length > allowed.shape[1]:
        allowed = torch.nn.functional.pad(allowed, (0, key_length - allowed.shape[1]))  # [N, key_length]: stale slots masked
    mask = torch.zeros(allowed.shape, dtype=dtype, device=past_mask.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def static_cache_length(cache) -> int | None:
    """Slots of a static cache (every layer attends over all of them), None for a dynamic one."""
    lengths = {layer.max_cache_len for layer in cache.layers if type(layer) is StaticLayer}
    return max(lengths) if lengths else None


def keep_cache_entries(cache, past: int, keep: list[int]) -> None:
    """After a tree forward, keep the first ``past`` entries and the tree nodes ``keep`` (in order).

    Tail-only: the kept nodes' K/V move into place right after the committed context; a dynamic layer slices the rest
    off (a view), a static layer sets its length (in place: its address stays) and the mask hides the stale slots.
    Nothing before ``past`` is touched."""
    source = None
    end = past + len(keep)
    for layer in cache.layers:
        if type(layer) not in (DynamicLayer, StaticLayer):
            raise ValueError(f"tree verification needs full-attention dynamic or static cache layers, got {type(layer).__name__}")
        if not layer.is_initialized:
            continue
        if source is None:
            source = (past + torch.tensor(keep, dtype=torch.long)).to(layer.keys.device)  # [m]
        layer.keys[..., past:end, :] = layer.keys.index_select(-2, source.to(layer.keys.device))  # [b, h, m, hd]
        layer.values[..., past:end, :] = layer.values.index_select(-2, source.to(layer.values.device))
        if type(layer) is StaticLayer:
            layer.cumulative_length.fill_(end)
        else:
            layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]


def walk(tree: TokenTree, node_logits, do_sample: bool, generator=None) -> tuple[list[int], int]:
    """Accepted path (node ids from the root) and the bonus token.

    node_logits(i) -> [V] processed logits of node i (computed only for nodes the walk visits).
    """
    path, node = [0], 0
    while True:
        logits = node_logits(node)
        if not do_sample:
            x = int(logits.argmax())
        else:
            x = None
            probs = torch.softmax(logits.float(), dim=-1)
            for child in tree.children[node]:  # x ~ p, checking the children's tokens first
                token = tree.tokens[child]
                mass = probs.sum()
                if mass <= 0:
                    break
                if torch.rand((), generator=generator, device=probs.device) * mass < probs[token]:
                    x = token
                    break
                probs[token] = 0.0
            if x is None:
                x = int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
        child = tree.child_with(node, x)
        if child is None:
            return path, x
        path.append(child)
        node = child


# Tokens committed per step by a tree of N nodes over those of one path of the same drafter (greedy, the shipped
# weights, fp32; docs/tree/acceptance_*.json: ShareGPT-dev 1.71 -> 1.81 / 2.02 / 2.22 / 2.35 at 4 / 8 / 16 / 32
# nodes, HumanEval 1.51 -> 1.64 / 1.79 / 1.91 / 2.02): the mean ratio of the two sets. Larger trees: not measured.
TREE_GAIN = {4: 1.07, 8: 1.18, 16: 1.28, 32: 1.36}
# A tree must promise this much more than one path: building and walking it costs host work per step that the
# cost model leaves out, and one path can also skip a useless draft (plain and n-gram steps) where a tree always drafts.
TREE_MARGIN = 1.1


def choose_tree_budget(costs, drafter_acceptance: list[float]) -> tuple[int, dict]:
    """(node budget, the values compared): a tree of N nodes where it commits the most tokens per unit of cost,
    else 0 (one path). ``costs``: a StepCosts; ``drafter_acceptance``: P(block position i accepted), calibrated.

    One path verifying L tokens commits ``1 + sum_{i<L} a_i`` for ``verify(L) + draft``; a tree commits
    ``TREE_GAIN[N]`` times the whole path's tokens for ``verify(N) + draft``; a plain step 1 for 1. The best tree
    is taken when it beats the best of the rest by ``TREE_MARGIN``.
    """
    values = {"plain": 1.0}
    expected = 1.0
    for length, a in enumerate(drafter_acceptance, start=1):
        expected += a
        values[f"path-{length}"] = expected / (costs.verify(length) + costs.draft)
    one_path = max(values.values())
    trees = {f"tree-{nodes}": expected * gain / (costs.verify(nodes) + costs.draft) for nodes, gain in TREE_GAIN.items()}
    values.update(trees)
    best = max(trees, key=trees.get)
    return (int(best.split("-")[1]) if trees[best] > TREE_MARGIN * one_path else 0), values


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
    if generation_config.return_dict_in_generate and (generation_config.output_attentions or generation_config.output_hidden_states):
        return ("tree verification returns sequences, scores, logits and the cache, not attentions or hidden states: "
                "drop output_attentions/output_hidden_states")
    return None


def refuse_unsupported(target, generation_config, cache=None) -> None:
    """Tree mode's limits, as clear errors (before the first forward)."""
    problem = tree_support_problem(target, generation_config, cache)
    if problem is not None:
        raise ValueError(f"tree verification (drafter.config.tree_budget) cannot run here: {problem}. "
                         "Set drafter.config.tree_budget = None (one path) for this call.")


# Attention backends that take an arbitrary (tree) mask; a flash kernel reads a 4D mask as a padding mask.
TREE_MASK_BACKEND = "sdpa"


@contextlib.contextmanager
def tree_mask_attention(target):
    """Run the target's attention through a backend that takes the 4D tree mask (SDPA) when its own cannot
    (flash-attention 2/3 and their hub-kernel variants). Same cache layout, so prefill and plain steps keep
    the fast kernel; only the verification forward switches."""
    config = target.config.get_text_config()
    current = config._attn_implementation
    if current is None or "flash" not in current:
        yield
        return
    config._attn_implementation_internal = TREE_MASK_BACKEND
    try:
        yield
    finally:
        config._attn_implementation_internal = current


@torch.no_grad()
def tree_decoding(target, drafter, input_ids, logits_processor, stopping_criteria, generation_config, streamer=None,
                  make_generator=None, budget=None, **model_kwargs):
    """The tree loop in place of transformers' ``_assisted_decoding``; same inputs, same outputs."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    cache = model_kwargs.get("past_key_values")
    refuse_unsupported(target, generation_config, cache)
    if input_ids.shape[0] != 1:
        raise ValueError(f"tree verification runs batch size 1, got {input_ids.shape[0]}: generate prompt by prompt")
    if cache is None:
        raise RuntimeError("tree verification needs the target's dynamic cache (use_cache=True)")
    gen = make_generator(target, drafter, generation_config, logits_processor)  # the drafter's context cache and stats
    if budget is None:
        budget = int(drafter.config.tree_budget or 0)
    gen.stats.mode = f"tree-{budget}" if budget else "linear"
    do_sample = bool(generation_config.do_sample)
    eos = getattr(generation_config, "_eos_token_tensor", None)
    eos = set() if eos is None else set(eos.view(-1).tolist())
    return_dict = generation_config.return_dict_in_generate
    scores = () if return_dict and generation_config.output_scores else None
    raw_logits = () if return_dict and generation_config.output_logits else None
    layers = [i + 1 for i in drafter.config.target_layer_ids]
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    lm_head = gen.lm_head
    vocab_ids = getattr(lm_head, "vocab_ids", None)
    vocab_ids = None if vocab_ids is None else vocab_ids.to(gen.device)

    # prefill: the prompt's features, the first token
    out = target(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True,
                 output_hidden_states=layers, logits_to_keep=1)
    gen.pending_features.append(gen.prompt_features(out.hidden_states, input_ids.shape[1]))
    slots = static_cache_length(cache)  # None: a dynamic cache
    raw = out.logits[:, -1].float()
    first = logits_processor(input_ids, raw.clone()) if len(logits_processor) else raw.clone()
    token = int(torch.multinomial(torch.softmax(first, -1), 1)) if do_sample else int(first.argmax())
    new = [token]
    if scores is not None:
        scores += (first,)
    if raw_logits is not None:
        raw_logits += (raw,)
    while True:
        input_ids = torch.cat([input_ids, torch.tensor([new], dtype=input_ids.dtype, device=input_ids.device)], dim=1)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((1, len(new)))], dim=1)
        if streamer is not None:
            streamer.put(torch.tensor(new))
        gen.stats.new_tokens = input_ids.shape[1] - gen.prompt_length
        if stopping_criteria(input_ids, scores).any():
            break
        room = generation_config.max_length - input_ids.shape[1]  # tokens this step may still add
        # 1-2. draft a block from the anchor, grow the tree
        t0 = time.perf_counter()
        past = input_ids.shape[1] - 1  # the cache holds every committed token but the anchor (on the host: no sync)
        anchor = int(input_ids[0, -1])
        tree = root_tree(anchor)
        choice = None
        if room > 1 and budget == 0:  # one path: the hybrid rule's proposal (block draft, n-gram or none) as one branch
            limit = room - 1 if slots is None else min(room - 1, slots - past - 1)
            choice, rates, tokens = path_proposal(gen, input_ids, attention_mask, limit)
            add_branch(tree, tokens)
        elif room > 1:
            hidden = gen.draft_hidden(input_ids, attention_mask)  # [1, B-1, H]
            logits = drafter.draft_logits(lm_head, hidden)[0]  # [B-1, V']
            candidates, log_probs = lattice_log_probs(drafter, hidden[0], logits, vocab_ids, anchor)
            branch = min(gen.ngram_tokens, room - 1) if gen.ngram is not None else 0
            nodes = budget if slots is None else max(0, min(budget, slots - past - 1 - branch))  # a static cache's slots bound the tree
            tree = build_tree(anchor, candidates, log_probs, nodes, room - 1)
            if gen.ngram is not None:
                gen.ngram.extend(input_ids[0, len(gen.ngram.ids):].tolist())
                match = gen.ngram.lookup(branch)
                if match is not None:
                    add_branch(tree, match.tokens)
        gen.stats.draft_seconds += time.perf_counter() - t0
        # 3. verify every node in one forward
        depths = torch.tensor(tree.depths, device=input_ids.device)
        with tree_mask_attention(target):
            out = target(input_ids=torch.tensor([tree.tokens], device=input_ids.device),
                         position_ids=(past + depths)[None],
                         attention_mask=tree_attention_mask(tree, attention_mask[0, :past], target.dtype, slots),
                         past_key_values=cache, use_cache=True, output_hidden_states=layers)
        node_raw = out.logits[0].float()  # [N, V]
        processed = {}

        def node_logits(i: int) -> torch.Tensor:  # processors see the node's own prefix
            if i not in processed:
                if len(logits_processor):
                    path = []
                    j = i
                    while j > 0:
                        path.append(tree.tokens[j])
                        j = tree.parents[j]
                    prefix = torch.cat([input_ids, torch.tensor([path[::-1]], dtype=input_ids.dtype, device=input_ids.device)], 1)
                    processed[i] = logits_processor(prefix, node_raw[i : i + 1].clone())[0]
                else:
                    processed[i] = node_raw[i]
            return processed[i]

        # 4. accept
        path, bonus = walk(tree, node_logits, do_sample)
        new = [tree.tokens[i] for i in path[1:]] + [bonus]
        new = new[: max(room, 1)]
        cut = next((k for k, t in enumerate(new) if t in eos), None)
        if cut is not None:
            new = new[: cut + 1]
        n_matches = len(new) - 1
        keep = path[: n_matches + 1]  # the root and the accepted nodes whose successors are committed
        # 5. commit: cache entries and drafter features of the kept nodes only
        keep_cache_entries(cache, past, keep)
        gen.pending_features.append(gen.node_features(out.hidden_states, keep))
        if budget:
            gen.stats.record_step(len(tree) - 1, n_matches, "dflash2-tree", depth=max(tree.depths))
        elif choice is None:  # one token of room left: a plain step
            gen.stats.record_step(0, n_matches, "none")
        else:
            gen.stats.record_step(choice.length, n_matches, choice.proposer)
            gen.rule.record(choice, rates, n_matches)
        if scores is not None:
            scores += tuple(node_logits(i)[None] for i in keep)
        if raw_logits is not None:
            raw_logits += tuple(node_raw[i][None] for i in keep)
    if streamer is not None:
        streamer.end()
    gen.stats.seconds = time.perf_counter() - gen.start_time
    if return_dict:
        return GenerateDecoderOnlyOutput(sequences=input_ids, scores=scores, logits=raw_logits, past_key_values=cache)
    return input_ids
