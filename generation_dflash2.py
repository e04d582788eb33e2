"""DFlash 2 speculative generation for ``target.generate(**inputs, assistant_model=drafter)``.

transformers 5.23 gives a remote-code assistant no hook of its own, so importing this module wraps two
``GenerationMixin`` methods once; when, and only when, the assistant is a DFlash 2 drafter:

* ``_validate_generation_mode``: only greedy decoding and sampling, clear errors otherwise; the pairing is
  checked; stateful targets (linear attention) pass, since ``rollback_dflash2`` rolls their state back exactly
* ``_assisted_decoding``: the call runs ``loop_dflash2.speculative_decoding`` instead of transformers' loop: one
  loop for one prompt and for a batch (one path or a tree per row and step, n-gram continuations, dynamic and
  static caches, compiled or not, stateful and sliding-window targets); transformers' candidate generators are
  never built for a DFlash 2 drafter (the loop drafts itself)

Every other call goes to transformers unchanged (transformers' own DFlash-1 path, ``speculation_type="dflash"``,
included). The target never runs twice per step: its verification forward also yields the next step's context
features (``output_hidden_states`` is asked for the tapped layers only).
"""

from __future__ import annotations

import functools
import sys

from .checks_dflash2 import (TESTED_RANGE_TEXT, TESTED_TRANSFORMERS, check_compatible, check_placement,  # noqa: F401 (API)
                             check_transformers_version, is_dflash2_drafter)
from .costs_dflash2 import cpu_has_native_bf16  # noqa: F401 (precision.py reads cpu_has_native_bf16 here)
from .costs_dflash2 import batch_costs
from .loop_dflash2 import speculative_decoding
from .proposer_dflash2 import Draft, Proposer, context_features, propose, reduce_streams  # noqa: F401 (API)
from .rollback_dflash2 import check_rollback_supported
from .stats_dflash2 import DFlash2Stats, collect_stats, trace_proposals  # noqa: F401 (API)
from .tree_dflash2 import choose_tree_budget, tree_support_problem

def decide_tree_budget(target, drafter, generation_config, cache, input_ids) -> int:
    """Nodes per tree for this call, 0 for one path per step. An explicit ``tree_budget`` is honoured (or refused
    clearly where a tree cannot be exact); ``"auto"`` takes a tree only where the target and call allow one and
    this device's measured costs (a batch's: ``batch_costs``) say it commits more tokens per unit of time
    (``tree_dflash2.choose_tree_budget``)."""
    setting = drafter.config.tree_budget
    if setting != "auto":
        return int(setting or 0)
    if tree_support_problem(target, generation_config, cache) is not None:
        return 0
    device = next(drafter.parameters()).device
    # a batch decides with the batch's costs (a tree per row verifies rows x N tokens where a plain step verifies
    # rows); TREE_GAIN is a mean over rows, like the paths' expected tokens it is compared with
    costs, _, _ = batch_costs(target, drafter, None, device, input_ids.shape[0])  # one row: step_costs' own
    budget, _ = choose_tree_budget(costs, drafter.config.hybrid_settings()["drafter_acceptance"])
    return budget


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
    """Route ``generate(assistant_model=<DFlash 2 drafter>)`` to ``loop_dflash2.speculative_decoding``. Idempotent."""
    from transformers.generation.utils import GenerationMixin

    if getattr(GenerationMixin._assisted_decoding, "_dflash2_hook", False):
        return
    original_validate = GenerationMixin._validate_generation_mode
    original_assisted = GenerationMixin._assisted_decoding

    @functools.wraps(original_assisted)
    def _assisted_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                           streamer=None, inputs_tensor=None, assistant_model=None, assistant_tokenizer=None, tokenizer=None,
                           **model_kwargs):
        drafter = assistant_model
        builtin = generation_config.speculation_type == "dflash" or generation_config.assistant_early_exit is not None
        if drafter is None or not is_dflash2_drafter(drafter) or builtin:  # transformers' own paths, unchanged
            return original_assisted(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus,
                                     streamer, inputs_tensor, assistant_model, assistant_tokenizer, tokenizer, **model_kwargs)
        check_transformers_version()
        # the drafter's OWN code (the hook is installed once, by whichever drafter module loaded first):
        # two drafter folders each run, and report statistics from, their own generation module
        own = sys.modules.get(type(drafter).__module__.rsplit(".", 1)[0] + ".generation_dflash2", sys.modules[__name__])
        budget = own.decide_tree_budget(self, drafter, generation_config, model_kwargs.get("past_key_values"), input_ids)
        return own.speculative_decoding(self, drafter, input_ids, logits_processor, stopping_criteria, generation_config,
                                        streamer, budget=budget, **model_kwargs)

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

    _assisted_decoding._dflash2_hook = True
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
    "DFlash2Stats",
    "Proposer",
    "collect_stats",
    "context_features",
    "dflash2_generate",
    "install_assisted_generation_hook",
    "propose",
    "speculative_decoding",
    "trace_proposals",
]
