"""Proposals for the target to verify: the block draft, the n-gram continuation, the tree.

``DFlash2Proposer`` is the per-call drafting state the decoding loop (``loop_dflash2.py``) asks each step for
one path (the hybrid rule's choice: a block draft, an n-gram continuation, or nothing) or a tree (the top-K
lattice of one block draft, plus the n-gram continuation as a branch). It holds the drafter's context cache
(the target features of committed tokens), the n-gram index, the rule and the call's statistics.

A block draft, from the anchor (the last committed token):

    1. the target's previous forward gave hidden states of the tokens it just committed; the features of
       ``target_layer_ids`` enter the drafter's context cache
    2. one drafter forward on ``[anchor, MASK * (B-1)]``; the block's K/V are cropped back off
    3. top-K of the draft logits at every position; the selector walks one path from the anchor (greedy,
       or sampled at the generation temperature: q, the proposal distribution exact sampling needs)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from .checks_dflash2 import check_compatible
from .costs_dflash2 import rule_costs, step_costs
from .ngram_dflash2 import HybridRule, NgramIndex, StepCosts
from .rollback_dflash2 import LinearStateRollback
from .stats_dflash2 import STATS_SINK, TRACE_SINK, DFlash2Stats
from .tree_dflash2 import lattice_log_probs, tree_with_branch

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


def compiled_call(model, compile_config):
    """``torch.compile`` of ``model.__call__`` under transformers' ``CompileConfig``, made once per model and config
    (kept on the model, as ``PreTrainedModel.get_compiled_call`` does, so later calls reuse the compiled graphs)."""
    options = compile_config.to_dict()
    cached = getattr(model, "_dflash2_compiled_call", None)
    if cached is None or cached[0] != options:
        cached = (options, torch.compile(model.__call__, **options))
        model._dflash2_compiled_call = cached
    return cached[1]


# ---- drafting ------------------------------------------------------------------------------------------------


@dataclass
class Draft:
    tokens: torch.Tensor  # [b, n]
    proposal_logits: torch.Tensor | None  # [b, n, V] log q (sampling) or None (greedy)
    confidence: torch.Tensor | None = None  # [b, n] the proposal's own probability of each token (temperature 1)


def draft_length_policy(generation_config, block_size: int) -> tuple[int, bool]:
    """(tokens verified per step, adapt it?) from transformers' ``num_assistant_tokens`` knobs.

    The drafter always drafts its whole block (the convs and the mask are per block), but only the
    first ``num_assistant_tokens`` (at most ``block_size - 1``; transformers' default 20 means all)
    go to the target. On compute-bound hardware (a CPU) verifying a token costs nearly as much as
    decoding one, so a short draft can beat the full block; on a GPU verification is almost free.
    ``num_assistant_tokens_schedule="heuristic"`` (or ``"heuristic_transient"``) adapts the length
    during a call the way transformers does for assistant models; here it always restarts per call.
    """
    n = generation_config.num_assistant_tokens
    if n is None:
        n = block_size - 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"num_assistant_tokens must be an integer >= 1 (got {n!r}); DFlash 2 verifies at most block_size - 1 = {block_size - 1}")
    schedule = generation_config.num_assistant_tokens_schedule or "constant"
    if schedule not in ("constant", "heuristic", "heuristic_transient"):
        raise ValueError(f"num_assistant_tokens_schedule={schedule!r} is not one of 'constant', 'heuristic', 'heuristic_transient'")
    return min(n, block_size - 1), schedule != "constant"


def propose(drafter, lm_head, hidden: torch.Tensor, anchor: torch.Tensor, temperature: float, generator=None) -> Draft:
    """Turn drafter hiddens at drafted positions ([b, n, H]) into proposed tokens.

    With a selector: top-K + selector walk; q = softmax(S/T) over the candidates.
    Without one (plain DFlash): argmax, or a sample from softmax(logits/T).
    ``lm_head`` may be a ``DraftVocabHead`` (``drafter.draft_head``): logits then cover its
    sub-vocabulary, and q is zero outside it (still exact speculative sampling: the residual
    max(p - q, 0) carries the target's mass there).
    """
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


def ngram_policy(generation_config, config) -> tuple[int, int, int]:
    """(continuation length, min n, max n) of the hybrid n-gram proposer; length 0 = off.

    transformers' own prompt-lookup knobs, passed together with ``assistant_model=drafter``, set
    the hybrid (they would otherwise select plain prompt lookup and ignore the drafter):
    ``prompt_lookup_num_tokens`` the continuation length (0 turns the n-gram proposer off),
    ``max_matching_ngram_size`` the longest n-gram matched. Unset: the drafter config's
    ``hybrid_ngram`` (defaults in configuration_dflash2.HYBRID_NGRAM_DEFAULTS).
    """
    settings = config.hybrid_settings()
    num_tokens, max_n = settings["num_tokens"], settings["max_n"]
    if generation_config.prompt_lookup_num_tokens is not None:
        num_tokens = generation_config.prompt_lookup_num_tokens
    if generation_config.max_matching_ngram_size is not None:
        max_n = generation_config.max_matching_ngram_size
    for name, value, low in (("prompt_lookup_num_tokens", num_tokens, 0), ("max_matching_ngram_size", max_n, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low} with a DFlash 2 drafter (0 turns the n-gram proposer off), got {value!r}")
    return num_tokens, min(settings["min_n"], max_n), max_n


def point_mass_logits(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log q for a deterministic proposal: 0 at each proposed token, -inf elsewhere. [b, n] -> [b, n, V]"""
    out = torch.full((*tokens.shape, vocab_size), float("-inf"), device=tokens.device)  # [b, n, V]
    return out.scatter(-1, tokens[..., None], 0.0)



@dataclass
class PathProposal:
    """One path for a step: the hybrid rule's choice (None: no room to propose), its per-token acceptance rates (what
    the rule records), the tokens, and log q [L, V] of each token's proposal distribution when they were sampled from
    the drafter (None: deterministic tokens -- greedy, or the n-gram's point mass)."""

    choice: object | None
    rates: list[float]
    tokens: list[int]
    log_q: torch.Tensor | None = None


class DFlash2Proposer:
    """Drafting state for one ``generate`` call (batch size 1): the drafter's context cache, the n-gram index, the
    hybrid rule, the stats, and (stateful targets) the rollback the loop drives."""

    def __init__(self, target, drafter, generation_config, logits_processor=None):
        check_compatible(target, drafter)
        self.drafter = drafter
        self.config = drafter.config
        self.device = next(drafter.parameters()).device
        self.embed_tokens = target.get_input_embeddings()
        self.lm_head = drafter.draft_head(target.get_output_embeddings())  # the target's, or its draft-vocabulary rows
        vocab_ids = getattr(self.lm_head, "vocab_ids", None)
        self.vocab_ids = None if vocab_ids is None else vocab_ids.to(self.device)
        self.draft_limit, self.adaptive = draft_length_policy(generation_config, self.config.block_size)
        self.temperature = float(generation_config.temperature or 1.0) if generation_config.do_sample else 0.0
        self.ngram_tokens, min_n, max_n = ngram_policy(generation_config, self.config)
        self.ngram = NgramIndex(min_n, max_n) if self.ngram_tokens else None
        settings = self.config.hybrid_settings()
        costs, source = step_costs(target, drafter, self.lm_head, self.device)  # measured once per process, or configured
        self.rule = HybridRule(settings["ngram_acceptance"], settings["drafter_scale"], settings["ngram_margin"],
                               settings["drafter_acceptance"], StepCosts(**rule_costs(costs)))
        self.trace = TRACE_SINK.get()  # a list to append per-step records to (trace_proposals), or None
        self.cache = DynamicCache()  # context K/V only; full layers (the sliding window is applied by the mask)
        self.slots = None  # a preallocated (static) drafter cache's slots (``preallocate``), else None
        self.compiled_step = None
        self.committed = 0  # tokens whose target features are in the drafter cache
        self.pending_features = []  # [1, n, n*H] features of committed tokens not yet in it (steps the drafter skipped)
        self.stats = DFlash2Stats(block_size=self.config.block_size, costs={**costs, "source": source})
        self.start_time = time.perf_counter()
        self.prompt_length = None
        # Stateful targets (linear attention): the recurrent state must be rolled back by replay.
        self.rollback = LinearStateRollback(target, owner=self) if getattr(target, "_is_stateful", False) else None
        sink = STATS_SINK.get()
        if sink is not None:
            sink.append(self.stats)

    # ---- drafting ----------------------------------------------------------------------------------------------

    def preallocate(self, max_length: int, compile_config=None) -> None:
        """Preallocate the drafter's context K/V (a static cache of every token the call may commit, plus one step's
        context rows and block); with ``compile_config``, drafter steps of up to ``context_rows`` new context tokens
        run through ONE compiled graph: their context is padded to that many rows (masked slots, overwritten later)."""
        from transformers.cache_utils import Cache, StaticLayer

        block = self.config.block_size
        self.context_rows = block  # a step commits at most a block (the accepted tokens and the bonus)
        self.slots = max_length + self.context_rows + block
        self.cache = Cache(layers=[StaticLayer(max_cache_len=self.slots) for _ in range(self.config.num_hidden_layers)])
        dtype = next(self.drafter.parameters()).dtype
        like = torch.empty(1, self.config.num_key_value_heads, 1, self.config.head_dim, dtype=dtype, device=self.device)
        for layer in self.cache.layers:  # allocated now, outside any compiled region (static addresses marked)
            layer.lazy_initialization(like, like)
        self.slot_ids = torch.arange(self.slots, device=self.device)  # [S]
        self.compiled_step = None if compile_config is None else compiled_call(self.drafter, compile_config)

    def draft_hidden(self, input_ids, attention_mask=None) -> torch.Tensor:
        """The drafter's hiddens [1, B-1, H] at the block's drafted positions, anchored at ``input_ids[:, -1]``;
        the pending context features enter the drafter cache, the block's K/V are cropped back off."""
        block = self.config.block_size
        features = torch.cat(self.pending_features, dim=1)  # [1, n_new, n*H]
        self.pending_features = []
        n_new = features.shape[1]
        block_ids = torch.cat([input_ids[:, -1:], input_ids.new_full((1, block - 1), self.config.mask_token_id)], dim=1)
        if self.slots is not None:
            return self._draft_hidden_static(features, block_ids, attention_mask)
        position_ids = torch.arange(self.committed, self.committed + n_new + block, device=input_ids.device)[None]
        mask = attention_mask
        if mask is not None:
            mask = torch.cat([mask[:, : self.committed + n_new], mask.new_ones((1, block))], dim=1)
        out = self.drafter(
            noise_embeds=self.drafter.embed_block(self.embed_tokens, block_ids),
            context_hidden_states=features,
            position_ids=position_ids,
            attention_mask=mask,
            past_key_values=self.cache,
        )
        self.cache.crop(-block)  # keep the context K/V only
        self.committed += n_new
        return out.last_hidden_state[:, 1:]  # [1, B-1, H]

    def _draft_hidden_static(self, features, block_ids, attention_mask) -> torch.Tensor:
        """``draft_hidden`` on the preallocated cache. Slots after the step: [0, start) the committed context,
        [start, start + c) the new context (n_new real rows, then padding), [start + c, start + c + B) the block;
        the cache's length is then set back to start + n_new, so padding and block are overwritten next step."""
        block, start, n_new = self.config.block_size, self.committed, features.shape[1]
        fixed = self.compiled_step is not None and n_new <= self.context_rows  # the compiled graph's shapes
        c = self.context_rows if fixed else n_new
        end = start + n_new  # tokens in the drafter's context after this step
        features = torch.nn.functional.pad(features, (0, 0, 0, c - n_new))  # [1, c, n*H]: padding rows at the end
        block_positions = end + self.slot_ids[:block]  # [B]: the block follows the last real context token
        position_ids = torch.cat([start + self.slot_ids[:c], block_positions])[None]  # [1, c + B]
        key_positions = self.slot_ids.clone()  # [S]: context slot s holds position s
        key_positions[start + c : start + c + block] = block_positions
        slot_mask = torch.zeros(self.slots, dtype=torch.long, device=self.device)  # [S] 1 = the slot holds a token
        slot_mask[:end] = 1 if attention_mask is None else attention_mask[0, :end].to(self.device)
        slot_mask[start + c : start + c + block] = 1
        out = (self.compiled_step if fixed else self.drafter)(
            noise_embeds=self.drafter.embed_block(self.embed_tokens, block_ids), context_hidden_states=features,
            position_ids=position_ids, attention_mask=slot_mask[None], key_positions=key_positions[None],
            past_key_values=self.cache)
        hidden = out.last_hidden_state[:, 1:].clone()  # [1, B-1, H] (a CUDA-graph replay reuses its output memory)
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(end)  # in place: the compiled graph keeps reading the same tensor
        self.committed = end
        return hidden

    def draft_path(self, input_ids, attention_mask, n_draft: int) -> Draft:
        """The block draft's first ``n_draft`` tokens (the selector's path) from the anchor ``input_ids[:, -1]``."""
        hidden = self.draft_hidden(input_ids, attention_mask)  # [1, B-1, H]
        return propose(self.drafter, self.lm_head, hidden[:, :n_draft], input_ids[:, -1], self.temperature)

    def extend_ngram_index(self, input_ids, history: list[int] | None = None) -> None:
        """The n-gram index takes the tokens committed since its last call: from ``history`` (the loop's host copy of
        the sequence, no device transfer) when given, else from ``input_ids``."""
        start = len(self.ngram.ids)
        self.ngram.extend(history[start:] if history is not None else input_ids[0, start:].tolist())

    def propose_path(self, input_ids, attention_mask, limit: int, history: list[int] | None = None) -> PathProposal:
        """One path of at most ``limit`` tokens, as the hybrid rule picks it: the n-gram continuation, the block draft
        (run only when the rule says it is worth its forward, or when proposals are traced) or nothing, cut to what
        pays (``ngram_dflash2.HybridRule``)."""
        match = None
        if self.ngram is not None:
            self.extend_ngram_index(input_ids, history)
            match = self.ngram.lookup(min(self.ngram_tokens, limit))
        n_draft = min(self.draft_limit, limit)
        confidences, drafted, log_q = None, [], None
        if n_draft > 0 and (self.ngram is None or self.trace is not None or self.rule.run_drafter(match, n_draft)):
            draft = self.draft_path(input_ids, attention_mask, n_draft)
            n = draft.tokens.shape[1]  # n_draft (a patched draft may hold fewer)
            host = torch.cat([draft.tokens[0].float(), draft.confidence[0].float()]).tolist()  # one transfer
            drafted, confidences = [int(t) for t in host[:n]], host[n:]
            log_q = None if draft.proposal_logits is None else draft.proposal_logits[0]  # [n_draft, V]
            if self.trace is not None:
                self.trace.append({"position": input_ids.shape[1], "draft": drafted, "confidence": confidences,
                                   "ngram": match.tokens if match else [], "match_length": match.match_length if match else 0})
        choice = self.rule.choose(match, confidences)
        if choice.proposer == "ngram":
            return PathProposal(choice, self.rule.ngram_rates(match), match.tokens[: choice.length])
        rates = self.rule.drafter_rates(confidences) if confidences is not None else []
        return PathProposal(choice, rates, drafted[: choice.length], None if log_q is None else log_q[: choice.length])

    def propose_tree(self, input_ids, attention_mask, anchor: int, budget: int, depth_limit: int, max_nodes: int | None = None,
                     history: list[int] | None = None):
        """A ``TokenTree``: the ``budget`` most probable nodes of the block's top-K lattice (at most ``depth_limit``
        deep), plus the n-gram continuation as a branch; ``max_nodes`` bounds both together (a static cache's slots)."""
        hidden = self.draft_hidden(input_ids, attention_mask)  # [1, B-1, H]
        logits = self.drafter.draft_logits(self.lm_head, hidden)[0]  # [B-1, V']
        candidates, log_probs = lattice_log_probs(self.drafter, hidden[0], logits, self.vocab_ids, anchor)
        if self.ngram is not None:
            self.extend_ngram_index(input_ids, history)
        return tree_with_branch(anchor, candidates, log_probs, budget, depth_limit, self.ngram_tokens,
                                self.ngram.lookup if self.ngram is not None else None, max_nodes)

    # ---- what the loop reads from the target's forwards ---------------------------------------------------------

    def prompt_features(self, hidden_states, n_tokens: int) -> torch.Tensor:
        """[1, n_tokens, n*H] context features of the prefill (and records the prompt length)."""
        self.prompt_length = n_tokens
        return context_features(hidden_states, self.config.target_layer_ids, n_tokens, self.config.target_hidden_reduction, self.device)

    def node_features(self, hidden_states, nodes: list[int]) -> torch.Tensor:
        """[1, len(nodes), n*H] context features of the given positions of a verification forward, on the drafter's device."""
        index = torch.tensor(nodes)
        return torch.cat([reduce_streams(hidden_states[l + 1].index_select(1, index.to(hidden_states[l + 1].device)),
                                         self.config.target_hidden_reduction).to(self.device)
                          for l in self.config.target_layer_ids], dim=-1)

    def record(self, n_matches: int, path: PathProposal | None = None, tree=None) -> None:
        """Statistics, the rule's acceptance record and the adaptive draft length after a step."""
        if tree is not None:
            self.stats.record_step(len(tree) - 1, n_matches, "dflash2-tree", depth=max(tree.depths))
            return
        if path is None or path.choice is None:  # no room to propose: a plain step
            self.stats.record_step(0, n_matches, "none")
            return
        choice = path.choice
        self.stats.record_step(choice.length, n_matches, choice.proposer)
        self.rule.record(choice, path.rates, n_matches)
        if self.adaptive and choice.proposer == "dflash2" and choice.length:  # transformers' heuristic: +2 after a
            full = n_matches == choice.length  # fully accepted draft, -1 otherwise
            self.draft_limit = min(self.config.block_size - 1, self.draft_limit + 2) if full else max(1, self.draft_limit - 1)


__all__ = ["DFlash2Proposer", "Draft", "PathProposal", "context_features", "propose", "reduce_streams"]
