"""DFlash 2 speculative generation for ``target.generate(**inputs, assistant_model=drafter)``.

One decoding step (transformers' assisted-decoding loop drives it; batch size 1):

    1. the target's previous verification forward gave hidden states of the tokens it just
       committed; keep only ``target_layer_ids`` and append them to the drafter's context cache
    2. draft: one drafter forward on ``[anchor, MASK * (B-1)]``; crop the block's K/V back off
    3. propose: top-K of the draft logits at every position, then the selector walks one
       path from the anchor (greedy, or sampled at the generation temperature); the hybrid
       rule (ngram_dflash2.py) verifies a prompt-lookup continuation instead when its expected
       accepted length is higher (q = the point mass on each n-gram token)
    4. verify: ONE target forward over the proposal; greedy keeps the longest prefix equal to
       the target's argmax, sampling runs exact speculative sampling with the selector's q
       as the proposal distribution (accept w.p. min(1, p/q), else resample norm(max(p-q, 0)))
    5. the accepted tokens plus one bonus token are committed; go to 1

The target never runs twice per step: its verification forward also yields the next
step's context features (``output_hidden_states`` is asked for those layers only).

transformers 5.23 gives a remote-code assistant no hook of its own, so importing this
module wraps ``GenerationMixin._get_candidate_generator`` (and the generation-mode check)
once: when, and only when, the assistant is a DFlash 2 drafter, our candidate generator is
used; every other call goes to transformers unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from dataclasses import dataclass

import torch
import transformers
from packaging import version
from transformers.cache_utils import DynamicCache
from transformers.generation.candidate_generator import CandidateGenerator

from .devices_dflash2 import execution_device
from .costs_dflash2 import cpu_has_native_bf16, rule_costs, step_costs  # noqa: F401 (precision.py reads cpu_has_native_bf16 here)
from .ngram_dflash2 import HybridRule, NgramIndex, StepCosts
from .stats_dflash2 import STATS_SINK, TRACE_SINK, DFlash2Stats, collect_stats, trace_proposals
from .rollback_dflash2 import LinearStateRollback, check_rollback_supported
from .tree_dflash2 import choose_tree_budget, tree_decoding, tree_support_problem

TESTED_TRANSFORMERS = (version.parse("5.23.0"), version.parse("5.24.0"))  # [min, max)
TESTED_RANGE_TEXT = "transformers>=5.23,<5.24"


def is_dflash2_drafter(model) -> bool:
    return bool(getattr(model, "_is_dflash2_drafter", False)) or type(model).__name__ == "DFlash2DraftModel"


def check_transformers_version() -> None:
    current = version.parse(transformers.__version__)
    if not TESTED_TRANSFORMERS[0] <= current < TESTED_TRANSFORMERS[1]:
        raise RuntimeError(
            f"DFlash 2 speculative generation is tested with {TESTED_RANGE_TEXT}; this is transformers "
            f"{transformers.__version__}, whose assisted-decoding internals may differ. "
            f"Install a tested version: pip install '{TESTED_RANGE_TEXT}'"
        )


# ---- compatibility checks ---------------------------------------------------------------------------------------


def _expected_target(drafter) -> str:
    cfg = drafter.config
    name = cfg.target_name_or_path or cfg.target_model_type or "the target it was trained for"
    return f"this drafter expects {name} (vocab {cfg.vocab_size}, hidden size {cfg.hidden_size}" + (
        f", {cfg.num_target_layers} layers)" if cfg.num_target_layers else ")"
    )


def check_compatible(target, drafter) -> None:
    """Raise a clear error when the drafter cannot serve this target."""
    tcfg = target.config.get_text_config()
    dcfg = drafter.config
    problems = []
    if tcfg.vocab_size != dcfg.vocab_size:
        problems.append(f"target vocab size {tcfg.vocab_size} != drafter vocab size {dcfg.vocab_size}")
    if tcfg.hidden_size != dcfg.hidden_size:
        problems.append(f"target hidden size {tcfg.hidden_size} != drafter hidden size {dcfg.hidden_size}")
    n_layers = tcfg.num_hidden_layers
    if dcfg.num_target_layers is not None and dcfg.num_target_layers != n_layers:
        problems.append(f"target has {n_layers} layers, drafter was built for {dcfg.num_target_layers}")
    elif max(dcfg.target_layer_ids) >= n_layers:
        problems.append(f"target_layer_ids {dcfg.target_layer_ids} do not exist in a {n_layers}-layer target")
    if problems:
        raise ValueError("Incompatible target for this DFlash 2 drafter: " + "; ".join(problems) + f". {_expected_target(drafter)}.")
    check_placement(target, drafter)


def check_placement(target, drafter) -> None:
    """Device and dtype checks against the modules the drafter talks to: the target's embedding table (block
    inputs) and LM head (draft logits). Those may sit on any device of a ``device_map`` or be offloaded by
    accelerate (weights on ``meta`` until their hooks load them): the drafter reads both through
    ``module_weights`` / the module itself and moves tensors to and from its own device."""
    d_param = next(drafter.parameters())
    head_device = execution_device(target.get_output_embeddings())
    if d_param.device.type == "meta":
        raise ValueError(
            f"the drafter's weights are on meta (offloaded): load it whole onto one device, e.g. "
            f"AutoModel.from_pretrained(..., device_map={{'': '{head_device}'}}) or drafter.to('{head_device}')"
        )
    if d_param.device.type != head_device.type:
        raise ValueError(
            f"drafter is on {d_param.device} but the target's LM head computes on {head_device}: "
            f"call drafter.to('{head_device}') (any {head_device.type} device of the target's device_map works)"
        )
    t_dtype = target.get_input_embeddings().weight.dtype  # meta weights keep their dtype
    if t_dtype != d_param.dtype:
        raise ValueError(
            f"drafter dtype {d_param.dtype} != target dtype {t_dtype}: load the drafter with "
            f"dtype=target.dtype or call drafter.to(target.dtype)"
        )


# ---- target features ---------------------------------------------------------------------------------------------


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


class DFlash2CandidateGenerator(CandidateGenerator):
    """Candidate generator for transformers' assisted-decoding loop (batch size 1)."""

    requires_model_outputs = True

    def __init__(self, target, drafter, generation_config, logits_processor=None):
        check_compatible(target, drafter)
        self.drafter = drafter
        self.config = drafter.config
        self.device = next(drafter.parameters()).device
        self.embed_tokens = target.get_input_embeddings()
        self.lm_head = drafter.draft_head(target.get_output_embeddings())  # the target's, or its draft-vocabulary rows
        self.max_length = generation_config.max_length
        self.draft_limit, self.adaptive = draft_length_policy(generation_config, self.config.block_size)
        self.temperature = float(generation_config.temperature or 1.0) if generation_config.do_sample else 0.0
        self.model_kwargs_overrides = {"output_hidden_states": [i + 1 for i in self.config.target_layer_ids]}
        self.ngram_tokens, min_n, max_n = ngram_policy(generation_config, self.config)
        self.ngram = NgramIndex(min_n, max_n) if self.ngram_tokens else None
        settings = self.config.hybrid_settings()
        costs, source = step_costs(target, drafter, self.lm_head, self.device)  # measured once per process, or configured
        self.rule = HybridRule(settings["ngram_acceptance"], settings["drafter_scale"], settings["ngram_margin"],
                               settings["drafter_acceptance"], StepCosts(**rule_costs(costs)))
        self.last_choice, self.last_rates = None, []
        self.last_proposer = None  # the proposal verified by the coming forward (None: the prefill, or no step)
        self.trace = TRACE_SINK.get()  # a list to append per-step records to (trace_proposals), or None
        self.cache = DynamicCache()  # context K/V only; full layers (the sliding window is applied by the mask)
        self.committed = 0  # tokens whose target features are in the drafter cache
        self.pending_features = []  # [1, n, n*H] features of committed tokens not yet in it (steps the drafter skipped)
        self.last_drafted = 0
        self.stats = DFlash2Stats(block_size=self.config.block_size, costs={**costs, "source": source})
        self._start = time.perf_counter()
        self._prompt_length = None
        # Stateful targets (linear attention): the recurrent state must be rolled back by replay.
        self.rollback = LinearStateRollback(target, owner=self) if getattr(target, "_is_stateful", False) else None
        sink = STATS_SINK.get()
        if sink is not None:
            sink.append(self.stats)

    @torch.no_grad()
    def get_candidates(self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False, n_last_matches=0, **kwargs):
        if self._prompt_length is None:
            self._prompt_length = input_ids.shape[1]
        self.last_drafted = 0
        if is_first_iteration:  # the target's prefill comes first: it yields the prompt's features
            return input_ids, None
        n_draft = min(self.draft_limit, self.max_length - input_ids.shape[1] - 1)
        if model_outputs is None or getattr(model_outputs, "hidden_states", None) is None:
            raise RuntimeError("DFlash 2 needs the target's hidden states from its verification forward")
        if self.rollback is not None:  # every later forward, a plain one-token step too, needs full conv windows
            self.rollback.pad_conv_windows(model_kwargs.get("past_key_values") if model_kwargs else model_outputs.past_key_values)
        if n_draft <= 0:
            return input_ids, None
        t0 = time.perf_counter()
        # features of the tokens committed by the last verification (the first positions of its forward)
        n_fresh = input_ids.shape[1] - 1 - self.committed - sum(f.shape[1] for f in self.pending_features)
        self.pending_features.append(context_features(
            model_outputs.hidden_states, self.config.target_layer_ids, n_fresh, self.config.target_hidden_reduction, self.device
        ))  # [1, n_fresh, n*H]
        match = None
        if self.ngram is not None:
            self.ngram.extend(input_ids[0, len(self.ngram.ids) :].tolist())  # only the newly committed tokens
            match = self.ngram.lookup(min(self.ngram_tokens, self.max_length - input_ids.shape[1] - 1))
        if self.ngram is not None and self.trace is None and not self.rule.run_drafter(match, n_draft):
            # a draft is not worth its forward: the n-gram or a plain step; the context features wait
            choice, tokens, proposal_logits, rates = self.rule.choose(match, None), None, None, []
        else:
            draft = self._draft(input_ids, model_kwargs, n_draft)
            tokens, proposal_logits = draft.tokens.to(input_ids.device), draft.proposal_logits
            confidence = draft.confidence[0].tolist()
            if self.trace is not None:
                self.trace.append({"position": input_ids.shape[1], "draft": draft.tokens[0].tolist(), "confidence": confidence,
                                   "ngram": match.tokens if match else [], "match_length": match.match_length if match else 0})
            choice, rates = self.rule.choose(match, confidence), self.rule.drafter_rates(confidence)
        if choice.proposer == "ngram":
            tokens = torch.tensor([match.tokens], dtype=input_ids.dtype, device=input_ids.device)  # [1, n]
            proposal_logits = point_mass_logits(tokens, self.config.vocab_size) if self.temperature > 0 else None  # q: point mass
            rates = self.rule.ngram_rates(match)
        self.last_choice, self.last_rates = choice, rates
        self.last_proposer, self.last_drafted = choice.proposer, choice.length
        self.stats.draft_seconds += time.perf_counter() - t0
        if choice.length == 0:  # nothing worth its verification cost: a plain one-token step
            return input_ids, None
        tokens = tokens[:, : choice.length]  # [1, L]
        proposal_logits = None if proposal_logits is None else proposal_logits[:, : choice.length]  # [1, L, V]
        if self.rollback is not None:
            self.rollback.begin_step(model_kwargs.get("past_key_values") if model_kwargs else model_outputs.past_key_values)
        return torch.cat([input_ids, tokens], dim=1), proposal_logits

    def _draft(self, input_ids, model_kwargs, n_draft: int) -> Draft:
        """One drafter forward over the pending context features + [anchor, MASK * (B-1)]; the selector's path."""
        return self.draft_path(input_ids, model_kwargs.get("attention_mask") if model_kwargs else None, n_draft)

    def draft_path(self, input_ids, attention_mask, n_draft: int) -> Draft:
        """The block draft's first ``n_draft`` tokens (the selector's path) from the anchor ``input_ids[:, -1]``."""
        hidden = self.draft_hidden(input_ids, attention_mask)  # [1, B-1, H]
        return propose(self.drafter, self.lm_head, hidden[:, :n_draft], input_ids[:, -1], self.temperature)

    def draft_hidden(self, input_ids, attention_mask=None) -> torch.Tensor:
        """The drafter's hiddens [1, B-1, H] at the block's drafted positions, anchored at ``input_ids[:, -1]``;
        the pending context features enter the drafter cache, the block's K/V are cropped back off."""
        block = self.config.block_size
        features = torch.cat(self.pending_features, dim=1)  # [1, n_new, n*H]
        self.pending_features = []
        n_new = features.shape[1]
        block_ids = torch.cat([input_ids[:, -1:], input_ids.new_full((1, block - 1), self.config.mask_token_id)], dim=1)
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

    # ---- what the tree loop (tree_dflash2.py) reads from the verification forward ----------------------------

    @property
    def prompt_length(self) -> int:
        return self._prompt_length

    @property
    def start_time(self) -> float:
        return self._start

    def prompt_features(self, hidden_states, n_tokens: int) -> torch.Tensor:
        """[1, n_tokens, n*H] context features of the prefill (and records the prompt length)."""
        self._prompt_length = n_tokens
        return context_features(hidden_states, self.config.target_layer_ids, n_tokens, self.config.target_hidden_reduction, self.device)

    def node_features(self, hidden_states, nodes: list[int]) -> torch.Tensor:
        """[1, len(nodes), n*H] context features of the given positions of a (tree) forward, on the drafter's device."""
        index = torch.tensor(nodes)
        return torch.cat([reduce_streams(hidden_states[l + 1].index_select(1, index.to(hidden_states[l + 1].device)),
                                         self.config.target_hidden_reduction).to(self.device)
                          for l in self.config.target_layer_ids], dim=-1)

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        proposer, self.last_proposer = self.last_proposer, None
        if proposer is not None:  # a decoding step (not the prefill); "none": nothing was worth verifying
            self.stats.record_step(self.last_drafted, int(num_matches), proposer)
            self.rule.record(self.last_choice, self.last_rates, int(num_matches))
        if self.last_drafted:
            if self.adaptive and proposer == "dflash2":  # transformers' heuristic: +2 after a fully accepted draft, -1 otherwise
                full = int(num_matches) == self.last_drafted
                self.draft_limit = min(self.config.block_size - 1, self.draft_limit + 2) if full else max(1, self.draft_limit - 1)
        if self.rollback is not None:  # transformers already cropped K/V, indexer keys and conv states
            self.rollback.finish_step(accepted=int(num_matches) + 1, fed=self.last_drafted + 1)
            self.stats.rollback_seconds = self.rollback.seconds
        self.stats.new_tokens = input_ids.shape[1] - self._prompt_length
        self.stats.seconds = time.perf_counter() - self._start


def needs_own_loop(generation_config, cache) -> bool:
    """One path per step on a static cache: transformers' assisted loop refuses it; the tree loop verifies the
    path as a one-branch tree."""
    return generation_config.cache_implementation == "static" or any(
        type(layer).__name__ == "StaticLayer" for layer in getattr(cache, "layers", [])
    )


def decide_tree_budget(target, drafter, generation_config, cache, input_ids) -> int:
    """Nodes per tree for this call, 0 for one path per step. An explicit ``tree_budget`` is honoured (or refused
    clearly where a tree cannot be exact); ``"auto"`` takes a tree only where the target and call allow one and
    this device's measured costs say it commits more tokens per unit of time (``tree_dflash2.choose_tree_budget``)."""
    setting = drafter.config.tree_budget
    if setting != "auto":
        return int(setting or 0)
    if input_ids.shape[0] != 1 or tree_support_problem(target, generation_config, cache) is not None:
        return 0
    device = next(drafter.parameters()).device
    costs, _ = step_costs(target, drafter, None, device)
    budget, _ = choose_tree_budget(StepCosts(**rule_costs(costs)), drafter.config.hybrid_settings()["drafter_acceptance"])
    return budget


@functools.lru_cache(maxsize=None)
def _reporting_execution_device(cls):
    """``cls`` whose ``device`` is the embedding's execution device (see ``device_of_offloaded_target``)."""
    return type(cls.__name__, (cls,), {"device": property(lambda self: self._dflash2_execution_device),
                                       "__qualname__": cls.__qualname__, "__module__": cls.__module__})


@contextlib.contextmanager
def device_of_offloaded_target(target):
    """transformers' assisted loop moves each candidate to ``target.device``, its FIRST parameter's device: ``meta`` when
    accelerate offloaded the embedding (e.g. a tied head sent to disk), and the verification forward then fails. For this
    call only, the target reports the device its embedding computes on; nothing else about it changes."""
    if target.device.type != "meta":
        yield
        return
    cls = type(target)
    target._dflash2_execution_device = execution_device(target.get_input_embeddings())
    target.__class__ = _reporting_execution_device(cls)
    try:
        yield
    finally:
        target.__class__ = cls
        del target._dflash2_execution_device


# ---- the hook into transformers ---------------------------------------------------------------------------------

_UNSUPPORTED_MODE_HELP = {
    "beam_search": "beam search (num_beams > 1)",
    "beam_sample": "beam sampling (num_beams > 1, do_sample=True)",
    "group_beam_search": "group beam search",
    "constrained_beam_search": "constrained beam search",
    "contrastive_search": "contrastive search (penalty_alpha with top_k)",
    "dola_generation": "DoLa decoding",
}


def install_assisted_generation_hook() -> None:
    """Route ``generate(assistant_model=<DFlash 2 drafter>)`` to DFlash2CandidateGenerator (and, with
    ``drafter.config.tree_budget``, the assisted loop to tree verification). Idempotent."""
    from transformers.generation.utils import GenerationMixin

    if getattr(GenerationMixin._get_candidate_generator, "_dflash2_hook", False):
        return
    original_get = GenerationMixin._get_candidate_generator
    original_validate = GenerationMixin._validate_generation_mode
    original_assisted = GenerationMixin._assisted_decoding

    @functools.wraps(original_assisted)
    def _assisted_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                           streamer=None, inputs_tensor=None, assistant_model=None, assistant_tokenizer=None, tokenizer=None,
                           **model_kwargs):
        drafter = assistant_model
        cache = model_kwargs.get("past_key_values")
        if (drafter is not None and is_dflash2_drafter(drafter) and generation_config.speculation_type != "dflash"
                and (getattr(drafter.config, "tree_budget", None) or needs_own_loop(generation_config, cache))):
            check_transformers_version()  # the assisted path checks it when building its candidate generator
            own = sys.modules.get(type(drafter).__module__.rsplit(".", 1)[0] + ".generation_dflash2", sys.modules[__name__])
            budget = own.decide_tree_budget(self, drafter, generation_config, cache, input_ids)
            if budget or own.needs_own_loop(generation_config, cache):
                return own.tree_decoding(self, drafter, input_ids, logits_processor, stopping_criteria, generation_config,
                                         streamer, make_generator=own.DFlash2CandidateGenerator, budget=budget, **model_kwargs)
        with device_of_offloaded_target(self) if drafter is not None and is_dflash2_drafter(drafter) else contextlib.nullcontext():
            return original_assisted(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus,
                                     streamer, inputs_tensor, assistant_model, assistant_tokenizer, tokenizer, **model_kwargs)

    @functools.wraps(original_get)
    def _get_candidate_generator(self, *args, **kwargs):
        drafter = kwargs.get("assistant_model")
        config = kwargs.get("generation_config", args[0] if args else None)
        builtin = config is not None and (
            config.speculation_type == "dflash"  # transformers' own DFlash-1 path (argmax drafting)
            or config.assistant_early_exit is not None
        )  # prompt_lookup_num_tokens with a DFlash 2 drafter sets the hybrid's n-gram length (ngram_policy)
        if drafter is None or not is_dflash2_drafter(drafter) or builtin:
            return original_get(self, *args, **kwargs)
        check_transformers_version()
        input_ids = kwargs.get("input_ids")
        if input_ids is not None and input_ids.shape[0] != 1:
            raise ValueError(
                f"DFlash 2 through target.generate(assistant_model=...) runs batch size 1 (transformers' assisted "
                f"decoding loop), got batch size {input_ids.shape[0]}: generate prompt by prompt"
            )
        # the drafter's OWN code (the hook is installed once, by whichever drafter module loaded first):
        # two drafter folders each run, and report statistics from, their own generation module
        own = sys.modules.get(type(drafter).__module__.rsplit(".", 1)[0] + ".generation_dflash2", sys.modules[__name__])
        return own.DFlash2CandidateGenerator(self, drafter, config, kwargs.get("logits_processor"))

    @functools.wraps(original_validate)
    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        drafter = generation_mode_kwargs.get("assistant_model")
        if drafter is not None and is_dflash2_drafter(drafter):
            mode = str(getattr(generation_mode, "value", generation_mode))
            if mode != "assisted_generation":
                what = _UNSUPPORTED_MODE_HELP.get(mode, mode)
                raise ValueError(
                    f"DFlash 2 drafting supports greedy decoding and sampling only, not {what}. "
                    "Use num_beams=1 (and no penalty_alpha), or generate without assistant_model."
                )
            if generation_config.speculation_type != "dflash":
                check_compatible(self, drafter)  # before transformers' own vocab check, whose advice would not apply
                if self._is_stateful:
                    # transformers refuses stateful targets because a recurrent state cannot be cropped;
                    # LinearStateRollback replays it exactly, so skip that one check (for this call only).
                    check_rollback_supported(self)
                    self._is_stateful = False  # instance attribute shadows the class flag
                    try:
                        return original_validate(self, generation_mode, generation_config, generation_mode_kwargs)
                    finally:
                        del self._is_stateful
        return original_validate(self, generation_mode, generation_config, generation_mode_kwargs)

    _get_candidate_generator._dflash2_hook = True
    GenerationMixin._get_candidate_generator = _get_candidate_generator
    GenerationMixin._validate_generation_mode = _validate_generation_mode
    GenerationMixin._assisted_decoding = _assisted_decoding


def dflash2_generate(target, drafter, inputs=None, **generate_kwargs):
    """Speculative generation that also returns its statistics.

    Returns ``(output_ids, DFlash2Stats)``; ``output_ids`` is exactly what
    ``target.generate(inputs, **generate_kwargs)`` returns (greedy) or a sample from the same
    distribution (sampling).
    """
    install_assisted_generation_hook()
    with collect_stats() as runs:
        out = target.generate(inputs, assistant_model=drafter, **generate_kwargs)
    stats = runs[-1] if runs else DFlash2Stats(block_size=drafter.config.block_size)
    return out, stats


__all__ = [
    "DFlash2CandidateGenerator",
    "DFlash2Stats",
    "collect_stats",
    "context_features",
    "dflash2_generate",
    "install_assisted_generation_hook",
    "propose",
    "trace_proposals",
]
