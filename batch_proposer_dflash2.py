"""Proposals for a batch: one drafter forward for every row, and per row its own n-gram index and hybrid rule.

``BatchProposer`` is the batched loop's (``batch_dflash2.py``) drafting state: the drafter's context cache for all
rows (rows keep different numbers of tokens per step, so it has holes like the target's: ``holes_dflash2``), and
per row the n-gram index of that row's text, a ``HybridRule`` fed with that row's outcomes only, and the row's
statistics. The rule's costs are the BATCH's (``batch_step_costs``): a step verifies ``rows x (1 + L)`` tokens
against the ``rows`` tokens of a plain batched step, so long proposals that pay for one row may not for a batch.
After every row proposed, ``batch_length`` picks the one length L the step verifies (shorter proposals are padded),
the L where the row that gains least still gains most per unit of the batch's cost (the batch waits for its
slowest row); L = 0 is a plain batched step.
"""

from __future__ import annotations

import time

import torch
from transformers.cache_utils import DynamicCache

from .checks_dflash2 import check_compatible
from .costs_dflash2 import rule_costs, step_costs
from .holes_dflash2 import compact, positions_from_mask, select_rows, should_compact
from .ngram_dflash2 import HybridRule, NgramIndex, Proposal, StepCosts, expected_tokens
from .proposer_dflash2 import PathProposal, context_features, draft_length_policy, ngram_policy, propose, reduce_streams
from .stats_dflash2 import STATS_SINK, DFlash2Stats
from .tree_dflash2 import lattice_lists, lattice_table, tree_with_branch


def batch_step_costs(costs: StepCosts, rows: int) -> StepCosts:
    """One row's costs (unit: a one-token forward of one row) -> a batch's (unit: a plain step of ``rows`` rows).

    The cost model prices a forward over m >= 2 tokens at ``1 + multi_token_step + per_token * (m - 1)`` one-token
    forwards. A batch verifying L drafted tokens per row runs ``rows * (1 + L)`` tokens where a plain batched step
    runs ``rows``: ``1 + per_token * rows * L / D`` plain steps, with D the plain step's own price. A draft is
    taken to scale like the target (its share of a step stays ``draft``)."""
    if rows == 1:
        return costs
    plain = 1.0 + costs.multi_token_step + costs.per_token * (rows - 1)
    return StepCosts(multi_token_step=0.0, per_token=costs.per_token * rows / plain, draft=costs.draft)


def batch_costs(target, drafter, lm_head, device, rows: int) -> tuple[StepCosts, dict, str]:
    """(the batch's StepCosts, the costs as found, their source) for a batch of ``rows``: measured at this batch
    size they are already the batch's; a configured dict or the one-row table is scaled (``batch_step_costs``)."""
    costs, source = step_costs(target, drafter, lm_head, device, rows)
    step = StepCosts(**rule_costs(costs))
    if source == "config" or source == "table":
        step = batch_step_costs(step, rows)
    return step, costs, source


def batch_length(proposals: list[PathProposal], rules: list[HybridRule], costs: StepCosts) -> int:
    """The one proposal length L the step verifies for every row.

    A batch runs until its slowest row is done, so a step is worth its extra cost only if EVERY row advances
    enough: the value of L is the least expected tokens of any row (its bonus token included) per unit of the
    batch's cost, against 1 for a plain batched step. (Summing tokens over rows instead, measured on the
    embedded target at batch 8, verified n-gram runs of single rows while the other rows waited: 0.90x of the
    target's batched generate on CHAMP.) Where verification is free (a GPU) every L pays and the longest wins."""
    best_value, best = -1.0, 0
    for length in sorted({0} | {len(p.tokens) for p in proposals}):
        tokens = min(expected_tokens(p.rates[: min(length, len(p.tokens))], rule.factor(p.choice.proposer) if p.choice and
                                     p.choice.proposer in rule.outcomes else 1.0) for p, rule in zip(proposals, rules))
        value = tokens / costs.verify(length)
        free = costs.verify(length) <= costs.verify(best)  # as cheap as the best so far: the longer one can only gain
        if value > best_value + 1e-9 or (value >= best_value - 1e-9 and free):
            best_value, best = value, length
    return best


def draft_pays(rules: list[HybridRule], matches: list, n_draft: list[int], costs: StepCosts) -> bool:
    """Before drafting: does a draft promise the batch more tokens per unit of cost, its forward included, than the
    rows' n-gram continuations alone (or a plain step)? Each option is valued as ``batch_length`` values a step, by
    the row that gains least at the best length; a row's draft by the drafter's calibrated mean acceptance."""
    def value(length: int, with_draft: bool) -> float:
        least = min(max(expected_tokens(rule.mean_drafter_rates(n)[:length], rule.factor("dflash2")) if with_draft and n else 1.0,
                        expected_tokens(rule.ngram_rates(m)[:length], rule.factor("ngram")) if m and m.tokens else 1.0)
                    for rule, m, n in zip(rules, matches, n_draft))
        return least / (costs.verify(length) + (costs.draft if with_draft else 0.0))

    longest = max([len(m.tokens) for m in matches if m] + n_draft)
    without = max(value(length, False) for length in range(longest + 1))
    return max((value(length, True) for length in range(1, max(n_draft) + 1)), default=0.0) > without


class BatchProposer:
    """Drafting state for one batched ``generate`` call; rows are indexed by their place in the current batch
    (``keep_rows`` drops finished ones), ``row_ids`` maps them back to the caller's rows."""

    def __init__(self, target, drafter, generation_config, prompts: list[list[int]]):
        check_compatible(target, drafter)
        rows = len(prompts)
        self.drafter, self.config = drafter, drafter.config
        self.device = next(drafter.parameters()).device
        self.embed_tokens = target.get_input_embeddings()
        self.lm_head = drafter.draft_head(target.get_output_embeddings())
        vocab_ids = getattr(self.lm_head, "vocab_ids", None)
        self.vocab_ids = None if vocab_ids is None else vocab_ids.to(self.device)
        self.draft_limit, _ = draft_length_policy(generation_config, self.config.block_size)  # constant in a batch
        self.temperature = float(generation_config.temperature or 1.0) if generation_config.do_sample else 0.0
        self.ngram_tokens, min_n, max_n = ngram_policy(generation_config, self.config)
        settings = self.config.hybrid_settings()
        self.costs, costs, source = batch_costs(target, drafter, self.lm_head, self.device, rows)
        self.rules = [HybridRule(settings["ngram_acceptance"], settings["drafter_scale"], settings["ngram_margin"],
                                 settings["drafter_acceptance"], self.costs) for _ in range(rows)]
        self.ngrams = [NgramIndex(min_n, max_n) for _ in range(rows)] if self.ngram_tokens else None
        for i, prompt in enumerate(prompts if self.ngrams else []):
            self.ngrams[i].extend(prompt)
        self.row_ids = list(range(rows))
        self.cache = DynamicCache()  # the drafter's context K/V for every row, with holes
        self.mask = torch.zeros(rows, 0, dtype=torch.long, device=self.device)  # [b, Tc] 1 = a real context entry
        self.real = [0] * rows  # real context entries per row (= the next context position)
        self.pending = []  # (features [b, n, n*H], mask [b, n]) not yet in the drafter cache
        self.stats = DFlash2Stats(block_size=self.config.block_size, costs={**costs, "source": source,
                                  "batch": rule_costs(vars(self.costs))}, batch_size=rows)
        self.stats.row_accept_lengths = [[] for _ in range(rows)]
        self.start_time = time.perf_counter()
        sink = STATS_SINK.get()
        if sink is not None:
            sink.append(self.stats)

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
        for name in ("rules", "ngrams", "row_ids", "real"):
            values = getattr(self, name)
            if values is not None:
                setattr(self, name, [values[i] for i in keep])

    # ---- drafting ----------------------------------------------------------------------------------------------

    def draft_hidden(self, anchors: torch.Tensor) -> torch.Tensor:
        """The drafter's hiddens [b, B-1, H] at every row's drafted positions (anchors [b] on the drafter's device);
        the pending features enter the context cache, the block's K/V are cropped back off."""
        block = self.config.block_size
        features = torch.cat([f for f, _ in self.pending], dim=1)  # [b, n, n*H]
        new_mask = torch.cat([m for _, m in self.pending], dim=1)  # [b, n]
        self.pending = []
        real = torch.tensor(self.real, device=self.device)  # [b]
        context_positions = positions_from_mask(new_mask, real)  # [b, n]
        after = real + new_mask.sum(-1)  # [b] the block's first position per row
        block_positions = after[:, None] + torch.arange(block, device=self.device)  # [b, B]
        block_ids = torch.cat([anchors[:, None], anchors.new_full((len(anchors), block - 1), self.config.mask_token_id)], 1)  # [b, B]
        keys = torch.cat([self.mask, new_mask, new_mask.new_ones(len(anchors), block)], dim=1).bool()  # [b, Tc + n + B]
        attention = keys[:, None, None, :].expand(-1, 1, block, -1)  # [b, 1, B, Tc + n + B]
        if self.config.is_causal:  # block position k sees block positions <= k
            tail = torch.ones(block, block, dtype=torch.bool, device=self.device).tril()
            attention = torch.cat([attention[..., :-block], attention[..., -block:] & tail], dim=-1)
        out = self.drafter(noise_embeds=self.drafter.embed_block(self.embed_tokens, block_ids), context_hidden_states=features,
                           position_ids=torch.cat([context_positions, block_positions], dim=1), attention_mask=attention,
                           past_key_values=self.cache)
        self.cache.crop(-block)  # keep the context K/V only
        self.mask = torch.cat([self.mask, new_mask], dim=1)
        self.real = after.tolist()
        if should_compact(self.mask.shape[1], self.real):
            self.mask = compact(self.cache, self.mask)
        return out.last_hidden_state[:, 1:]  # [b, B-1, H]

    def propose(self, anchors: list[int], new_tokens: list[list[int]], limits: list[int]) -> list[PathProposal]:
        """One path per row (``limits[i]``: at most that many tokens), as that row's rule picks it; ONE drafter
        forward serves every row when a draft pays for the batch (``draft_pays``). ``new_tokens``: per row, the tokens
        committed since the last call (the n-gram index grows from host lists, no device transfer)."""
        rows = len(anchors)
        matches = [None] * rows
        if self.ngrams is not None:
            for i in range(rows):
                self.ngrams[i].extend(new_tokens[i])
                matches[i] = self.ngrams[i].lookup(min(self.ngram_tokens, limits[i]))
        n_draft = [min(self.draft_limit, limit) for limit in limits]
        without_draft = [self.rules[i].choose(matches[i], None) for i in range(rows)]  # each row's choice if no draft runs
        confidences, drafted, log_q = [None] * rows, [[] for _ in range(rows)], None
        if any(n_draft) and (self.ngrams is None or draft_pays(self.rules, matches, n_draft, self.costs)):
            t0 = time.perf_counter()
            longest = max(n_draft)
            hidden = self.draft_hidden(torch.tensor(anchors, device=self.device))  # [b, B-1, H]
            draft = propose(self.drafter, self.lm_head, hidden[:, :longest], torch.tensor(anchors, device=self.device), self.temperature)
            host = torch.cat([draft.tokens.float(), draft.confidence.float()], dim=1).tolist()  # ONE transfer: [b, 2n]
            n = draft.tokens.shape[1]
            for i in range(rows):
                drafted[i] = [int(t) for t in host[i][: min(n, n_draft[i])]]
                confidences[i] = host[i][n : n + len(drafted[i])] if drafted[i] else None
            log_q = draft.proposal_logits  # [b, n, V] or None (greedy)
            self.stats.draft_seconds += time.perf_counter() - t0
        out = []
        for i in range(rows):
            choice = self.rules[i].choose(matches[i], confidences[i]) if confidences[i] is not None else without_draft[i]
            if choice.proposer == "ngram":
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
        deep), plus the row's n-gram continuation as a branch; ``max_nodes`` bounds both together (a static cache's
        slots). ONE drafter forward and ONE transfer for the batch."""
        t0 = time.perf_counter()
        anchor_ids = torch.tensor(anchors, device=self.device)  # [b]
        hidden = self.draft_hidden(anchor_ids)  # [b, B-1, H]
        logits = self.drafter.draft_logits(self.lm_head, hidden)  # [b, B-1, V']
        host = lattice_table(self.drafter, hidden, logits, self.vocab_ids, anchor_ids).cpu()  # [b, B-1, 1 + K, K]: the one transfer
        trees = []
        for i in range(len(anchors)):
            candidates, log_probs = lattice_lists(host[i])
            if self.ngrams is not None:
                self.ngrams[i].extend(new_tokens[i])
            trees.append(tree_with_branch(anchors[i], candidates, log_probs, budget, limits[i], self.ngram_tokens,
                                          self.ngrams[i].lookup if self.ngrams is not None else None, max_nodes))
        self.stats.draft_seconds += time.perf_counter() - t0
        return trees

    def record_trees(self, trees: list, accepted: list[int]) -> None:
        """Statistics after a tree step (the hybrid rule picks paths only; trees do not feed it)."""
        for i, (tree, n) in enumerate(zip(trees, accepted)):
            self.stats.record_step(len(tree) - 1, n, "dflash2-tree", depth=max(tree.depths))
            self.stats.row_accept_lengths[self.row_ids[i]].append(n + 1)
        self.stats.forwards += 1

    def record(self, proposals: list[PathProposal], accepted: list[int]) -> None:
        """After a verification: each row's rule learns from its own outcome; statistics per row and pooled."""
        for i, (proposal, n) in enumerate(zip(proposals, accepted)):
            choice = proposal.choice
            self.stats.record_step(choice.length, n, choice.proposer)
            self.stats.row_accept_lengths[self.row_ids[i]].append(n + 1)
            self.rules[i].record(choice, proposal.rates, n)
        self.stats.forwards += 1


def cut(proposal: PathProposal, length: int) -> PathProposal:
    """The proposal's first ``length`` tokens (the batch's length); nothing left is a plain step for the row."""
    if length >= len(proposal.tokens):
        return proposal
    kept = proposal.tokens[:length]
    choice = Proposal(proposal.choice.proposer if kept else "none", len(kept))
    log_q = None if proposal.log_q is None else proposal.log_q[:length]
    return PathProposal(choice, proposal.rates, kept, log_q)


__all__ = ["BatchProposer", "batch_costs", "batch_length", "batch_step_costs", "draft_pays"]
