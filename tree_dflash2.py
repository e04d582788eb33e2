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
``_assisted_decoding`` (``install_tree_hook``), with the logits processors, stopping criteria,
streamer, max_length and EOS handling that loop gets from ``generate``.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicLayer


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


def build_tree(anchor: int, candidates: torch.Tensor, child_log_probs, budget: int, max_depth: int) -> TokenTree:
    """Best-first token tree under a node budget.

    candidates: [n, K] token ids per draft position; child_log_probs(t, parent_token) -> [K] log-probs
    of the candidates at position t after ``parent_token``. Children of one node are distinct
    (the top-K are), so the tree has no duplicate paths.
    """
    tree = root_tree(anchor)
    depth_limit = min(max_depth, candidates.shape[0])
    if budget <= 0 or depth_limit <= 0:
        return tree
    heap, tie = [], 0

    def push_children(node: int, log_p: float):
        nonlocal tie
        t = tree.depths[node]  # children sit at draft position t (depth t + 1)
        if t >= depth_limit:
            return
        for k, lp in enumerate(child_log_probs(t, tree.tokens[node]).tolist()):
            heapq.heappush(heap, (-(log_p + lp), tie, node, int(candidates[t, k])))
            tie += 1

    push_children(0, 0.0)
    while heap and len(tree) - 1 < budget:
        neg, _, parent, token = heapq.heappop(heap)
        push_children(tree.add(token, parent), -neg)
    return tree


def add_branch(tree: TokenTree, tokens: list[int]) -> TokenTree:
    """Merge a continuation of the root (e.g. the n-gram proposal) into the tree, sharing prefixes."""
    node = 0
    for token in tokens:
        child = tree.child_with(node, token)
        node = child if child is not None else tree.add(token, node)
    return tree


def selector_log_probs(drafter, hidden: torch.Tensor, logits: torch.Tensor, vocab_ids: torch.Tensor | None):
    """(candidates [n, K] token ids, child_log_probs) from one block's drafter output.

    hidden [n, H], logits [n, V'] at the drafted positions. With a selector the children's
    log-probs are log softmax S_t(parent, .) over the top-K (they depend on the parent token);
    without one, the log softmax of the draft logits over the top-K.
    """
    selector = drafter.candidate_selector
    k = selector.top_k if selector is not None else min(8, logits.shape[-1])
    top_values, top_cols = logits.float().topk(k, dim=-1)  # [n, K]
    candidates = top_cols if vocab_ids is None else vocab_ids[top_cols]  # [n, K] token ids
    if selector is None:
        flat = torch.log_softmax(top_values, dim=-1)  # [n, K]
        return candidates, lambda t, parent: flat[t]
    gated = selector.hidden_projection(hidden).float()  # [n, R]
    cache = {}

    def child_log_probs(t: int, parent: int) -> torch.Tensor:
        if (t, parent) not in cache:
            prev = torch.tensor([parent], device=candidates.device)
            s = selector.scores(gated[t : t + 1], top_values[t : t + 1], candidates[t : t + 1], prev)  # [1, K]
            cache[t, parent] = torch.log_softmax(s[0], dim=-1)
        return cache[t, parent]

    return candidates, child_log_probs


def tree_attention_mask(tree: TokenTree, past_mask: torch.Tensor, dtype) -> torch.Tensor:
    """Additive 4D mask [1, 1, N, past + N]: the committed context (its own padding mask) and ancestors."""
    allowed = torch.cat([past_mask.bool()[None].expand(len(tree), -1), tree.ancestor_mask().to(past_mask.device)], dim=1)  # [N, past + N]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=past_mask.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def keep_cache_entries(cache, past: int, keep: list[int]) -> None:
    """After a tree forward, keep the first ``past`` entries and the tree nodes ``keep`` (in order)."""
    index = None
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise ValueError(f"tree verification needs full-attention dynamic cache layers, got {type(layer).__name__}")
        if not layer.is_initialized:
            continue
        if index is None:
            index = torch.cat([torch.arange(past), past + torch.tensor(keep, dtype=torch.long)]).to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, index)
        layer.values = layer.values.index_select(-2, index)


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


# Nodes per tree by device, for tree_budget="auto". CPU: measured on a 2-core AVX2 EPYC in fp32 (docs/evaluation.md):
# a 17-node forward costs what the 8-token block costs (2.0x a one-token forward) and 16 nodes gave the most tokens
# per cost of 0/4/8/16/32 (the shipped weights, ShareGPT-dev); 32 nodes cost 2.9x. GPU: not measured here; a
# forward of a few dozen tokens costs about one decode step there, so the budget is larger.
DEFAULT_TREE_BUDGET = {"cpu": 16, "cuda": 32}


def default_tree_budget(param: torch.Tensor) -> int:
    return DEFAULT_TREE_BUDGET.get(param.device.type, DEFAULT_TREE_BUDGET["cpu"])


def resolve_budget(budget, param: torch.Tensor) -> int:
    return default_tree_budget(param) if budget == "auto" else int(budget or 0)


def refuse_unsupported(target, generation_config) -> None:
    """Tree mode's limits, as clear errors."""
    if getattr(target, "_is_stateful", False) or getattr(target, "_dflash2_was_stateful", False):
        raise ValueError(
            "tree verification (drafter.config.tree_budget) cannot run on a stateful target: its linear-attention "
            "state would scan all tree branches in one order. Set drafter.config.tree_budget = None (linear drafts "
            "with exact rollback) for this target.")
    if generation_config.return_dict_in_generate and (generation_config.output_attentions or generation_config.output_hidden_states):
        raise ValueError("tree verification returns sequences, scores, logits and the cache; it cannot return attentions or "
                         "hidden states: drop output_attentions/output_hidden_states or set drafter.config.tree_budget = None")


@torch.no_grad()
def tree_decoding(target, drafter, input_ids, logits_processor, stopping_criteria, generation_config, streamer=None,
                  make_generator=None, **model_kwargs):
    """The tree loop in place of transformers' ``_assisted_decoding``; same inputs, same outputs."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    refuse_unsupported(target, generation_config)
    if input_ids.shape[0] != 1:
        raise ValueError(f"tree verification runs batch size 1, got {input_ids.shape[0]}: generate prompt by prompt")
    gen = make_generator(target, drafter, generation_config, logits_processor)  # the drafter's context cache and stats
    cache = model_kwargs.get("past_key_values")
    if cache is None:
        raise RuntimeError("tree verification needs the target's dynamic cache (use_cache=True)")
    budget = resolve_budget(drafter.config.tree_budget, next(target.parameters()))
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

    # prefill: the prompt's features, the first token
    out = target(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True,
                 output_hidden_states=layers, logits_to_keep=1)
    gen.pending_features.append(gen.prompt_features(out.hidden_states, input_ids.shape[1]))
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
        past = cache.get_seq_length()
        anchor = int(input_ids[0, -1])
        tree = root_tree(anchor)
        if room > 1:
            hidden = gen.draft_hidden(input_ids, attention_mask)  # [1, B-1, H]
            logits = drafter.draft_logits(lm_head, hidden)[0]  # [B-1, V']
            candidates, child_log_probs = selector_log_probs(drafter, hidden[0], logits, vocab_ids)
            tree = build_tree(anchor, candidates, child_log_probs, budget, room - 1)
            if gen.ngram is not None:
                gen.ngram.extend(input_ids[0, len(gen.ngram.ids):].tolist())
                match = gen.ngram.lookup(min(gen.ngram_tokens, room - 1))
                if match is not None:
                    add_branch(tree, match.tokens)
        gen.stats.draft_seconds += time.perf_counter() - t0
        # 3. verify every node in one forward
        depths = torch.tensor(tree.depths, device=input_ids.device)
        out = target(input_ids=torch.tensor([tree.tokens], device=input_ids.device),
                     position_ids=(past + depths)[None],
                     attention_mask=tree_attention_mask(tree, attention_mask[0, :past], target.dtype),
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
        gen.stats.record_step(len(tree) - 1, n_matches, "dflash2-tree", depth=max(tree.depths))
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
