"""What a DFlash 2 call checks before it runs: the transformers version, the target-drafter pairing, placement, and
the generation knobs it reads (draft length, n-gram continuation).

Each check raises one clear error that names the problem and the fix; nothing here runs a forward.
"""

from __future__ import annotations

import transformers
from packaging import version

from .devices_dflash2 import execution_device

TESTED_TRANSFORMERS = (version.parse("5.23.0"), version.parse("5.24.0"))  # [min, max)
TESTED_RANGE_TEXT = "transformers>=5.23,<5.24"


def is_dflash2_drafter(model) -> bool:
    return bool(getattr(model, "_is_dflash2_drafter", False)) or type(model).__name__ == "DFlash2DraftModel"


def check_transformers_version() -> None:
    current = version.parse(transformers.__version__)
    if not TESTED_TRANSFORMERS[0] <= current < TESTED_TRANSFORMERS[1]:
        raise RuntimeError(
            f"DFlash 2 speculative generation is tested with {TESTED_RANGE_TEXT}; this is transformers "
            f"{transformers.__version__}, whose generation internals (the generate() hooks, cache classes) may differ. "
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


def draft_length_policy(generation_config, block_size: int) -> tuple[int, bool]:
    """(tokens verified per step, adapt it?) from transformers' ``num_assistant_tokens`` knobs: the drafter drafts its
    whole block, the first ``num_assistant_tokens`` (at most ``block_size - 1``) are verified (a CPU pays per verified
    token); ``num_assistant_tokens_schedule="heuristic"`` adapts it per row during a call, as transformers does."""
    n = generation_config.num_assistant_tokens
    if n is None:
        n = block_size - 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"num_assistant_tokens must be an integer >= 1 (got {n!r}); DFlash 2 verifies at most block_size - 1 = {block_size - 1}")
    schedule = generation_config.num_assistant_tokens_schedule or "constant"
    if schedule not in ("constant", "heuristic", "heuristic_transient"):
        raise ValueError(f"num_assistant_tokens_schedule={schedule!r} is not one of 'constant', 'heuristic', 'heuristic_transient'")
    return min(n, block_size - 1), schedule != "constant"


def ngram_policy(generation_config, config) -> tuple[int, int, int]:
    """(continuation length, min n, max n) of the hybrid n-gram proposer (length 0: off): transformers' prompt-lookup
    knobs passed with ``assistant_model=drafter`` (``prompt_lookup_num_tokens``, ``max_matching_ngram_size``), else the
    drafter config's ``hybrid_ngram`` (defaults: configuration_dflash2.HYBRID_NGRAM_DEFAULTS)."""
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
