"""Proposals for the target to verify, for every row of a call at once: block drafts, n-gram continuations, trees.

``Proposer`` is the per-call drafting state the decoding loop (``loop_dflash2.py``) asks each step for one path per
row (that row's hybrid rule picks its block draft, its n-gram continuation or nothing; the batch verifies one
length) or one tree per row (the top-K lattice of the row's block draft, plus its n-gram continuation as a branch).
It holds the drafter's context cache for every row, each row's n-gram index and rule, and the call's statistics.

A block draft, from each row's anchor (its last committed token), ONE drafter forward for the batch:

    1. the target's previous forward gave hidden states of the tokens each row just committed; the features of
       ``target_layer_ids`` enter the drafter's context cache (a row that kept fewer leaves holes, masked)
    2. one drafter forward on ``[anchor, MASK * (B-1)]`` per row; the block's K/V are dropped again
    3. top-K of the draft logits at every position; the selector walks one path from the anchor (greedy,
       or sampled at the generation temperature: q, the proposal distribution exact sampling needs)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicCache, StaticLayer

from .checks_dflash2 import check_compatible, draft_length_policy, ngram_policy
from .costs_dflash2 import batch_costs, rule_costs
from .holes_dflash2 import compact, crop_tail, positions_from_mask, select_rows, should_compact
from .ngram_dflash2 import (HybridRule, NgramIndex, NgramMatch, PathProposal, Proposal, batch_length, copy_beats_tree, cut,
                            draft_pays, suffix_match, tree_branch_length)
from .stats_dflash2 import STATS_SINK, TRACE_SINK, DFlash2Stats
from .selector_dflash2 import lattice_lists, lattice_table
from .tree_dflash2 import add_branch, root_tree, tree_prior, tree_with_branch

def reduce_streams(hidden: torch.Tensor, reduction: str | None) -> torch.Tensor:
    """Hyper-connection targets give [b, t, streams, H]; reduce to [b, t, H] the way the config says."""
    if hidden.dim() == 3:
        return hidden
    if reduction in (None, "mean"):
        return hidden.mean(dim=2)
    if reduction == "first":
        return hidden[:, :, 0]
    if reduction == "concat":
        return hidden.flatten(2)
    raise ValueError(f"unknown target_hidden_reduction {reduction!r}")


def context_features(hidden_states, layer_ids: list[int], n_tokens: int, reduction: str | None = None, device=None) -> torch.Tensor:
    """Features of the first ``n_tokens`` positions of a target forward: [b, n_tokens, len(layer_ids) * H], on
    ``device`` (the drafter's; the taps of a sharded target come from the devices their layers sit on).

    ``hidden_states[0]`` is the embedding output, so target layer ``l`` is ``hidden_states[l + 1]``.
    """
    return torch.cat([reduce_streams(hidden_states[l + 1][:, :n_tokens], reduction).to(device) for l in layer_ids], dim=-1)


# ---- drafting ------------------------------------------------------------------------------------------------


@dataclass
class Draft:
    tokens: torch.Tensor  # [b, n]
    proposal_logits: torch.Tensor | None  # [b, n, V] log q (sampling) or None (greedy)
    confidence: torch.Tensor | None = None  # [b, n] the proposal's own probability of each token (temperature 1)


def propose(drafter, lm_head, hidden: torch.Tensor, anchor: torch.Tensor, temperature: float, generator=None) -> Draft:
    """Drafter hiddens at drafted positions ([b, n, H]) -> proposed tokens: with a selector, top-K + its walk (q =
    softmax(S/T) over the candidates); without, argmax or a sample from softmax(logits/T). With a ``DraftVocabHead``
    q is zero outside its sub-vocabulary (still exact: the residual max(p - q, 0) carries the target's mass there)."""
    logits = drafter.draft_logits(lm_head, hidden).float()  # [b, n, V'] (V' = V without a sub-vocabulary)
    vocab_ids = getattr(lm_head, "vocab_ids", None)  # [V'] or None
    vocab_ids = None if vocab_ids is None else vocab_ids.to(logits.device)  # the head may sit on another device
    vocab_size = drafter.config.vocab_size
    if drafter.candidate_selector is not None:
        walk = drafter.candidate_selector.walk(hidden, logits, anchor, temperature, generator, vocab_ids=vocab_ids)
        return Draft(walk.tokens, walk.full_vocab_logits(vocab_size) if temperature > 0 else None, walk.confidence)
    if temperature > 0:
        log_q = torch.log_softmax(logits / temperature, dim=-1)  # [b, n, V']
        b, n, v = log_q.shape
        tokens = torch.multinomial(log_q.exp().view(b * n, v), 1, generator=generator).view(b, n)
        confidence = logits.softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)  # [b, n]
        if vocab_ids is not None:
            tokens = vocab_ids[tokens]  # [b, n] token ids
            log_q = log_q.new_full((b, n, vocab_size), float("-inf")).index_copy(-1, vocab_ids, log_q)  # [b, n, V]
        return Draft(tokens, log_q, confidence)
    confidence, tokens = logits.softmax(-1).max(dim=-1)  # [b, n] each
    return Draft(tokens if vocab_ids is None else vocab_ids[tokens], None, confidence)


class Proposer:
    """Drafting state for one ``generate`` call over ``rows`` rows (one prompt is a batch of one).

    Rows are indexed by their place in the current batch (``keep_rows`` drops finished ones); ``row_ids`` maps them
    back to the caller's rows. The drafter's context cache holds every row's committed features with holes where a
    row kept fewer tokens than the step wrote (``holes_dflash2``); its keys carry their positions
    (``key_positions``), so a sliding-window drafter layer counts positions, not slots. ``preallocate`` makes that
    cache static (and, with a compile config, the drafter step one compiled graph)."""

    def __init__(self, target, drafter, generation_config, prompts: list[list[int]]):
        check_compatible(target, drafter)
        rows = len(prompts)
        self.drafter, self.config = drafter, drafter.config
        self.device = next(drafter.parameters()).device
        self.embed_tokens = target.get_input_embeddings()
        self.lm_head = drafter.draft_head(target.get_output_embeddings())  # the target's, or its draft-vocabulary rows
        vocab_ids = getattr(self.lm_head, "vocab_ids", None)
        self.vocab_ids = None if vocab_ids is None else vocab_ids.to(self.device)
        limit, self.adaptive = draft_length_policy(generation_config, self.config.block_size)
        self.draft_limits = [limit] * rows  # per row: ``num_assistant_tokens_schedule="heuristic"`` adapts each
        self.temperature = float(generation_config.temperature or 1.0) if generation_config.do_sample else 0.0
        self.ngram_tokens, min_n, max_n = ngram_policy(generation_config, self.config)
        settings = self.config.hybrid_settings()
        self.costs, costs, source = batch_costs(target, drafter, self.lm_head, self.device, rows)
        self.rules = [HybridRule(settings["ngram_acceptance"], settings["drafter_scale"], settings["ngram_margin"],
                                 settings["drafter_acceptance"], self.costs) for _ in range(rows)]
        self.ngrams = [NgramIndex(min_n, max_n) for _ in range(rows)] if self.ngram_tokens else None
        for i, prompt in enumerate(prompts if self.ngrams else []):
            self.ngrams[i].extend(prompt)
        # earlier calls' outputs (``drafter.suffix_index``: learns every call's outputs when enabled; asked only when it
        # holds some). Copied continuations share prompt lookup's length, so ``prompt_lookup_num_tokens=0`` turns
        # both off; each row's context is its n-gram index's token list.
        index = getattr(drafter, "suffix_index", None)
        self.index = index if self.ngram_tokens and index is not None and index.enabled else None
        self.suffix = self.index if self.index is not None and len(self.index) else None
        self.lengths = [len(p) for p in prompts]  # per row: committed tokens (its anchor sits at length - 1)
        self.row_ids = list(range(rows))
        self.trace = TRACE_SINK.get()  # a list to append per-step records to (trace_proposals), or None
        self.cache = DynamicCache()  # the drafter's context K/V for every row, with holes
        self.slots = None  # a preallocated (static) drafter cache's slots (``preallocate``)
        self.compiled_step = None
        self.mask = torch.zeros(rows, 0, dtype=torch.long, device=self.device)  # [b, Tc] 1 = a real context entry
        self.real = [0] * rows  # real context entries per row (= the next context position)
        self.pending = []  # (features [b, n, n*H], mask [b, n]) not yet in the drafter cache
        self.step_copies, self.step_tree_prior, self.step_found = [None] * rows, [None] * rows, []  # per row, per step
        batch = {"batch": rule_costs(vars(self.costs))} if rows > 1 else {}  # a batch's own costs, as the rule uses them
        self.stats = DFlash2Stats(block_size=self.config.block_size, costs={**costs, "source": source, **batch}, batch_size=rows)
        self.stats.row_accept_lengths = [[] for _ in range(rows)]
        self.start_time = time.perf_counter()
        sink = STATS_SINK.get()
        if sink is not None:
            sink.append(self.stats)

    def preallocate(self, max_length: int, compile_config=None) -> None:
        """A static drafter cache: every slot the call may fill (committed context with its holes, one step's new
        context padded to a block, the block); with ``compile_config`` the drafter step runs ONE compiled graph
        (transformers' ``get_compiled_call``) for every step of up to a block of new context."""
        block = self.config.block_size
        self.slots = max_length + 2 * block
        self.cache = Cache(layers=[StaticLayer(max_cache_len=self.slots) for _ in range(self.config.num_hidden_layers)])
        dtype = next(self.drafter.parameters()).dtype
        like = torch.empty(len(self.real), self.config.num_key_value_heads, 1, self.config.head_dim, dtype=dtype, device=self.device)
        for layer in self.cache.layers:  # allocated now, outside any compiled region (static addresses)
            layer.lazy_initialization(like, like)
        self.compiled_step = None if compile_config is None else self.drafter.get_compiled_call(compile_config)

    # ---- what the loop reads from the target's forwards ---------------------------------------------------------

    def add_prompt(self, hidden_states, mask: torch.Tensor) -> None:
        """The prefill's features of every (left-padded) prompt; padding enters as holes."""
        features = context_features(hidden_states, self.config.target_layer_ids, mask.shape[1], self.config.target_hidden_reduction, self.device)
        self.pending.append((features, mask.to(self.device)))  # [b, P, n*H], [b, P]

    def add_kept(self, hidden_states, kept_mask: torch.Tensor, order: torch.Tensor | None = None) -> None:
        """Features of the first K slots of a verification forward; row i's first ``kept[i]`` are real. ``order``
        [b, W]: the slots in kept-first order (trees: ``holes_dflash2.kept_first``)."""
        width = kept_mask.shape[1]

        def first(h):  # [b, W, ...] -> [b, K, ...]
            if order is None:
                return h[:, :width]
            index = order[:, :width].to(h.device)  # [b, K]
            return h.gather(1, index.view(*index.shape, *[1] * (h.dim() - 2)).expand(*index.shape, *h.shape[2:]))

        features = torch.cat([reduce_streams(first(hidden_states[l + 1]), self.config.target_hidden_reduction).to(self.device)
                              for l in self.config.target_layer_ids], dim=-1)  # [b, K, n*H]
        self.pending.append((features, kept_mask.to(self.device)))

    def keep_rows(self, keep: list[int]) -> None:
        """Keep only the batch rows ``keep`` (places in the current batch)."""
        index = torch.tensor(keep, device=self.device)
        select_rows(self.cache, index)
        self.mask = self.mask.index_select(0, index)
        self.pending = [(f.index_select(0, index), m.index_select(0, index)) for f, m in self.pending]
        for name in ("rules", "ngrams", "row_ids", "real", "lengths", "draft_limits"):
            values = getattr(self, name)
            if values is not None:
                setattr(self, name, [values[i] for i in keep])

    # ---- drafting ----------------------------------------------------------------------------------------------

    def draft_hidden(self, anchors: torch.Tensor) -> torch.Tensor:
        """The drafter's hiddens [b, B-1, H] at every row's drafted positions (anchors [b] on the drafter's device);
        the pending features enter the context cache, the block's K/V are dropped again.

        Keys: [committed context with holes | new context | block]; each key's position comes from its row's mask
        (``positions_from_mask``), the block follows the row's last real context position."""
        block = self.config.block_size
        features = torch.cat([f for f, _ in self.pending], dim=1)  # [b, n, n*H]
        new_mask = torch.cat([m for _, m in self.pending], dim=1)  # [b, n]
        self.pending = []
        rows, n_new = new_mask.shape
        if self.slots is not None and self.mask.shape[1] + max(n_new, block) + block > self.slots:
            self.mask = compact(self.cache, self.mask)  # in place: the static slots stay where they are
        fixed = self.compiled_step is not None and n_new <= block  # the compiled graph's shapes (more context: eager)
        padded = block if fixed else n_new
        features = torch.nn.functional.pad(features, (0, 0, 0, padded - n_new))  # [b, c, n*H]: padding rows at the end
        new_mask = torch.nn.functional.pad(new_mask, (0, padded - n_new))  # [b, c]
        real = torch.tensor(self.real, device=self.device)  # [b]
        after = real + new_mask.sum(-1)  # [b] the block's first position per row
        block_positions = after[:, None] + torch.arange(block, device=self.device)  # [b, B]
        context_mask = torch.cat([self.mask, new_mask], dim=1)  # [b, Tc + c]
        key_positions = torch.cat([positions_from_mask(context_mask), block_positions], dim=1)  # [b, Tc + c + B]
        key_mask = torch.cat([context_mask, context_mask.new_ones(rows, block)], dim=1)  # [b, Tc + c + B]
        if self.slots is not None:  # every slot is a key; those past the block are stale
            key_positions = torch.nn.functional.pad(key_positions, (0, self.slots - key_positions.shape[1]))  # [b, S]
            key_mask = torch.nn.functional.pad(key_mask, (0, self.slots - key_mask.shape[1]))  # [b, S]
        block_ids = torch.cat([anchors[:, None], anchors.new_full((rows, block - 1), self.config.mask_token_id)], 1)  # [b, B]
        step = self.compiled_step if fixed else self.drafter
        out = step(noise_embeds=self.drafter.embed_block(self.embed_tokens, block_ids), context_hidden_states=features,
                   position_ids=torch.cat([key_positions[:, self.mask.shape[1] : context_mask.shape[1]], block_positions], 1),
                   attention_mask=key_mask, key_positions=key_positions, past_key_values=self.cache)
        hidden = out.last_hidden_state[:, 1:]  # [b, B-1, H]
        if fixed:
            hidden = hidden.clone()  # a CUDA-graph replay reuses its output memory
        crop_tail(self.cache, block + padded - n_new)  # keep the real context columns only
        self.mask = torch.cat([self.mask, new_mask[:, :n_new]], dim=1)
        self.real = after.tolist()
        if self.slots is None and should_compact(self.mask.shape[1], self.real):
            self.mask = compact(self.cache, self.mask)
        return hidden

    def draft_block(self, anchors: list[int], n: int) -> Draft:
        """Every row's block draft from its anchor, its first ``n`` tokens (the selector's path) [b, n]."""
        anchor_ids = torch.tensor(anchors, device=self.device)  # [b]
        hidden = self.draft_hidden(anchor_ids)  # [b, B-1, H]
        return propose(self.drafter, self.lm_head, hidden[:, :n], anchor_ids, self.temperature)

    def _grow(self, new_tokens: list[list[int]]) -> None:
        for i, tokens in enumerate(new_tokens):
            self.lengths[i] += len(tokens)
            if self.ngrams is not None:
                self.ngrams[i].extend(tokens)

    def suffix_trie(self, row: int, num_tokens: int):
        """The suffix index's continuations (at most ``num_tokens`` deep) of the row's committed text, or None."""
        return self.suffix.lookup(self.ngrams[row].ids, num_tokens) if self.suffix is not None and num_tokens > 0 else None

    def copied_matches(self, limits: list[int]) -> list[NgramMatch | None]:
        """Per row, the copied continuation worth more (``HybridRule.better_match``): this call's (prompt lookup) or
        earlier calls' (the suffix index), at most ``min(ngram_tokens, limits[i])`` tokens; None where neither has one."""
        rows = len(limits)
        if self.ngrams is None:
            return [None] * rows
        lengths = [min(self.ngram_tokens, limit) for limit in limits]
        self.step_found = [(n, self.ngrams[i].lookup(n), self.suffix_trie(i, n)) for i, n in enumerate(lengths)]
        if self.suffix is None:
            return [match for _, match, _ in self.step_found]
        return [self.rules[i].better_match(match, suffix_match(trie, n)) for i, (n, match, trie) in enumerate(self.step_found)]

    def copies(self, row: int, num_tokens: int) -> tuple:
        """(prompt lookup's match, the suffix trie) of the row, ``num_tokens`` deep: this step's (``copied_matches``)
        when the depth is theirs, else looked up again (a static cache with little room left)."""
        depth, match, trie = self.step_found[row]
        if num_tokens == depth:
            return match, trie
        return self.ngrams[row].lookup(num_tokens), self.suffix_trie(row, num_tokens)

    def remember(self, prompts: list[list[int]], outputs: list[list[int]]) -> None:
        """After the call: every row's output enters the drafter's suffix index (when it has an enabled one)."""
        for prompt, output in zip(prompts, outputs) if self.index is not None else ():
            self.index.add(output, prompt)

    def propose(self, anchors: list[int], new_tokens: list[list[int]], limits: list[int]) -> list[PathProposal]:
        """One path per row (``limits[i]``: at most that many tokens), as that row's rule picks it; ONE drafter
        forward serves every row when a draft pays for the batch (``draft_pays``; always when proposals are traced).
        ``new_tokens``: per row, the tokens committed since the last call (host lists, no device transfer).

        The batch then verifies one length for every row (``batch_length``: a row's shorter proposal is padded)."""
        self._grow(new_tokens)
        rows = len(anchors)
        matches = self.copied_matches(limits)
        n_draft = [min(d, limit) for d, limit in zip(self.draft_limits, limits)]
        confidences, drafted, log_q = [None] * rows, [[] for _ in range(rows)], None
        if any(n_draft) and (self.ngrams is None or self.trace is not None or draft_pays(self.rules, matches, n_draft, self.costs)):
            t0 = time.perf_counter()
            draft = self.draft_block(anchors, max(n_draft))
            host = torch.cat([draft.tokens.float(), draft.confidence.float()], dim=1).tolist()  # ONE transfer: [b, 2n]
            n = draft.tokens.shape[1]
            for i in range(rows):
                drafted[i] = [int(t) for t in host[i][: min(n, n_draft[i])]]
                confidences[i] = host[i][n : n + len(drafted[i])] if drafted[i] else None
            log_q = draft.proposal_logits  # [b, n, V] or None (greedy)
            self.stats.draft_seconds += time.perf_counter() - t0
            if self.trace is not None:
                self.trace += [{"position": self.lengths[i], "draft": drafted[i], "confidence": confidences[i] or [],
                                "ngram": matches[i].tokens if matches[i] else [],
                                "match_length": matches[i].match_length if matches[i] else 0} for i in range(rows)]
        out = []
        for i in range(rows):
            choice = self.rules[i].choose(matches[i], confidences[i])
            if choice.proposer in ("ngram", "suffix"):
                out.append(PathProposal(choice, self.rules[i].ngram_rates(matches[i]), matches[i].tokens[: choice.length]))
            else:
                rates = self.rules[i].drafter_rates(confidences[i]) if confidences[i] is not None else []
                q = None if log_q is None or choice.proposer != "dflash2" else log_q[i, : choice.length]
                out.append(PathProposal(choice, rates, drafted[i][: choice.length], q))
        length = batch_length(out, self.rules, self.costs)
        return [cut(p, length) for p in out]

    def propose_trees(self, anchors: list[int], new_tokens: list[list[int]], limits: list[int], budget: int,
                      max_nodes: int | None = None) -> list:
        """A ``TokenTree`` per row: the ``budget`` most probable nodes of the row's top-K lattice (at most ``limits[i]``
        deep), plus the row's copied continuations as branches; ``max_nodes`` bounds both together (a static cache's
        slots). ONE drafter forward and ONE transfer for the batch. When the rows' copied continuations alone promise
        more per unit of cost (``copy_beats_tree``), they are the step's trees (chains) and the drafter does not run."""
        self._grow(new_tokens)
        rows = len(anchors)
        self.step_copies, self.step_tree_prior = [None] * rows, [None] * rows
        matches = self.copied_matches(limits)
        prior = tree_prior(self.rules[0].drafter_acceptance, self.config.block_size, budget)  # the calibration, as the rules hold it
        branch = self.ngram_tokens
        if self.trace is None and any(matches):  # the copies alone, without a drafter forward, when they promise more
            tree_tokens = [1.0 + prior * rule.factor("tree") for rule in self.rules]
            length = copy_beats_tree(self.rules, matches, tree_tokens, budget, self.costs)
            if length:
                self.step_copies = [PathProposal(Proposal(m.proposer, min(length, len(m.tokens))), self.rules[i].ngram_rates(m),
                                                 m.tokens[:length]) if m else PathProposal(Proposal("none", 0), [], [])
                                    for i, m in enumerate(matches)]
                return [add_branch(root_tree(a), p.tokens) for a, p in zip(anchors, self.step_copies)]
            branch = tree_branch_length(self.rules, matches, tree_tokens, budget, self.costs)  # the tree: as much as pays
        self.step_tree_prior = [None if m else prior for m in matches]
        t0 = time.perf_counter()
        anchor_ids = torch.tensor(anchors, device=self.device)  # [b]
        hidden = self.draft_hidden(anchor_ids)  # [b, B-1, H]
        logits = self.drafter.draft_logits(self.lm_head, hidden)  # [b, B-1, V']
        host = lattice_table(self.drafter, hidden, logits, self.vocab_ids, anchor_ids).cpu()  # [b, B-1, 1 + K, K]: the one transfer
        trees = []
        for i in range(len(anchors)):
            candidates, log_probs = lattice_lists(host[i])
            trees.append(tree_with_branch(anchors[i], candidates, log_probs, budget, limits[i], branch,
                                          None if self.ngrams is None else lambda n, i=i: self.copies(i, n), max_nodes))
        self.stats.draft_seconds += time.perf_counter() - t0
        return trees

    def record(self, accepted: list[int], proposals: list[PathProposal] | None = None, trees: list | None = None) -> None:
        """After a verification: statistics per row and pooled; with paths, each row's rule learns from its own
        outcome and (``num_assistant_tokens_schedule="heuristic"``) its draft length adapts (transformers' rule: +2
        after a fully accepted draft, -1 otherwise). ``accepted[i]``: row i's drafted tokens committed (None: a dead
        row of a compiled call, not counted)."""
        for i, n in enumerate(accepted):
            if n is None:
                continue
            path = proposals[i] if trees is None else self.step_copies[i]  # a tree call's copy verified alone: a path
            if path is None:
                self.stats.record_step(len(trees[i]) - 1, n, "dflash2-tree", depth=max(trees[i].depths))
                if self.step_tree_prior[i] is not None:  # a tree without a copied branch: how good trees are here
                    self.rules[i].outcomes["tree"][0] += n
                    self.rules[i].outcomes["tree"][1] += self.step_tree_prior[i]
            else:
                choice = path.choice
                self.stats.record_step(choice.length, n, choice.proposer)
                self.rules[i].record(choice, path.rates, n)
                if self.adaptive and choice.proposer == "dflash2" and choice.length:
                    full = n == choice.length
                    self.draft_limits[i] = (min(self.config.block_size - 1, self.draft_limits[i] + 2) if full
                                            else max(1, self.draft_limits[i] - 1))
            self.stats.row_accept_lengths[self.row_ids[i]].append(n + 1)
        self.stats.forwards += 1


__all__ = ["Draft", "Proposer", "context_features", "propose", "reduce_streams"]
