"""DFlash 2 drafter configuration: the drafter's own architecture (a Qwen3-style decoder stack) and its relation to
the TARGET it drafts for (the target layers that feed it, the mask token, the block size, the logit transforms).

``config.json`` is read by three consumers at once: transformers ``AutoConfig``/``AutoModel`` with
``trust_remote_code`` (``auto_map``); transformers' built-in DFlash path (``target_layer_ids``, ``block_size``,
``mask_token_id`` at the top level); SGLang / vLLM (``architectures: ["DFlash2DraftModel"]`` and the nested
``dflash_config``). The official release format (``model_type: qwen3`` + nested ``dflash_config``) loads too.
"""

from __future__ import annotations

import math

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters

# Keys of the nested ``dflash_config`` dict read by SGLang and vLLM.
DFLASH_CONFIG_KEYS = ("block_size", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "mask_token_id",
                      "target_layer_ids", "output_multiplier", "final_logit_softcapping", "input_embedding_scale",
                      "target_hidden_reduction")
# Keys engines accept in ``dflash_config`` beside those (vLLM, SGLang, LMDeploy, llama.cpp's converter).
# Each is either mapped onto this config (same semantics) or refused when it asks for something this
# code does not implement -- never ignored:
#   use_swa, swa_window_size, sliding_window: the drafter's sliding window (``layer_types``/``sliding_window``)
#   causal: a causal mask inside the block (``is_causal``)
#   sample_from_anchor: False is DFlash (slot k predicts token anchor+k); True is another model family
#   is_neox_style: True is the rotate-half RoPE used here; False (interleaved RoPE) is not implemented
#   attention_sink_bias: attention sinks are not implemented; only a false value loads
#   num_target_layers: the target's depth, as at the top level
ENGINE_DFLASH_CONFIG_KEYS = (
    "use_swa", "swa_window_size", "sliding_window", "causal", "sample_from_anchor", "is_neox_style",
    "attention_sink_bias", "num_target_layers",
)
# Optional keys are written only when set, as in the official checkpoint.
_OPTIONAL_DFLASH_KEYS = ("output_multiplier", "final_logit_softcapping", "input_embedding_scale", "target_hidden_reduction")
TARGET_HIDDEN_REDUCTIONS = ("mean", "first", "concat")

# The hybrid n-gram proposer's defaults (see ngram_dflash2.py; the rule's numbers are calibrated
# by ``python -m dflash2_tools.calibrate_hybrid`` and written into a checkpoint's ``hybrid_ngram``).
# Defaults: the fit on the shipped SmolLM2 drafter (docs/hybrid/calibration.json).
HYBRID_NGRAM_DEFAULTS = {
    "num_tokens": 12,  # measured: 12 beat 7 on ShareGPT-dev (2.15x vs 1.91x), level elsewhere (docs/evaluation.md)
    "min_n": 1,
    "max_n": 4,
    "ngram_acceptance": [0.0, 0.378, 0.672, 0.772, 0.928],
    "drafter_scale": 1.2,
    "ngram_margin": -0.5,
    "drafter_acceptance": [0.388, 0.177, 0.086, 0.034, 0.024, 0.002, 0.002],
    "costs": None,  # None or "measured": this device's, measured once (kept on disk); "table"; a dict (costs_dflash2.step_costs)
}


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Spread ``num_draft_layers`` context taps over the target: ``round(1 + i*(L-4)/(n-1))``."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    step = (num_target_layers - 4) / (num_draft_layers - 1)
    return [int(math.floor(1 + i * step + 0.5)) for i in range(num_draft_layers)]


def is_official_dflash2_config(config_dict: dict) -> bool:
    """The release format: Qwen3 hyperparameters, ``DFlash2DraftModel`` architecture, nested ``dflash_config``."""
    return (
        config_dict.get("model_type") == "qwen3"
        and "DFlash2DraftModel" in (config_dict.get("architectures") or [])
        and isinstance(config_dict.get("dflash_config"), dict)
    )


@strict
class DFlash2Config(PreTrainedConfig):
    r"""
    Configuration of a DFlash 2 block-diffusion drafter.

    Architecture of the drafter (Qwen3-style decoder, non-causal inside a block):
        vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
        num_key_value_heads, head_dim, hidden_act, rms_norm_eps, rope_parameters,
        max_position_embeddings, attention_bias, attention_dropout, sliding_window, layer_types.
        ``vocab_size`` and ``hidden_size`` are the TARGET's: the drafter uses the target's
        embedding table and LM head, which are never stored in the drafter checkpoint.

    Relation to the target:
        num_target_layers (`int`): layer count of the target (validates ``target_layer_ids``).
        target_layer_ids (`list[int]`): target layers whose outputs feed the drafter
            (``hidden_states[l + 1]`` in transformers). Default: spread over the target.
        block_size (`int`): tokens per draft block, anchor included (drafts ``block_size - 1``).
        mask_token_id (`int`): an unused row of the target's embedding table.
        output_multiplier, final_logit_softcapping, input_embedding_scale (`float`, optional):
            the target's own logit/embedding transforms, reproduced on the draft side.
        target_hidden_reduction (`str`, optional): how a target with several residual
            streams per layer (hyper-connections, hidden states ``[b, t, streams, H]``)
            is reduced to ``[b, t, H]``: ``"mean"`` (as the target's own final collapse).
        target_model_type, target_name_or_path (`str`, optional): which target this drafter
            was trained for; named in the error raised for an incompatible target.
        draft_vocab_ids (`list[int]`, optional): draft only from these token ids (the most
            frequent ones in the target's own responses). The LM head is then evaluated on
            this sub-vocabulary: on a CPU the full head is most of a draft's cost. Lossless
            either way (the target verifies); a target token outside the list just cannot be
            drafted. Top-level key only: engines that do not know it draft from the full head.
        hybrid_ngram (`dict`, optional): the prompt-lookup proposer beside the block draft
            (``ngram_dflash2.py``): ``num_tokens`` (continuation length, 0 = off), ``min_n``,
            ``max_n``, the calibrated rule ``ngram_acceptance`` (per match length),
            ``drafter_scale``, ``ngram_margin``, ``drafter_acceptance`` (mean P(position i accepted)),
            and ``costs`` (a step's costs in one-token forwards: a dict; None or ``"measured"``: on the device at
            first use, kept on disk; ``"table"``: the per-device-class table; ``costs_dflash2.step_costs``). Unset
            keys take ``HYBRID_NGRAM_DEFAULTS``.
            Per call, transformers' own ``prompt_lookup_num_tokens`` / ``max_matching_ngram_size``
            override ``num_tokens`` / ``max_n``. Top-level key only (engines ignore it).
        tree_budget (`int` or `"auto"`, optional): verify a token tree of this many drafted nodes (best
            paths through the top-K lattice, plus the n-gram branch) in one target forward instead
            of one path (``tree_dflash2.py``); ``"auto"``: a tree (and its size) only where this device's
            measured step costs (a batch's own, for a batch) say it commits more tokens per unit of time
            than one path (``tree_dflash2.choose_tree_budget``), and only on targets where a tree is exact (full attention,
            dynamic cache, not stateful); one path elsewhere. None or 0: one path. An explicit node count
            is refused clearly where a tree cannot be exact. Top-level key only (engines ignore it).

    DFlash 2 additions (each pair is all-or-none; ``None`` gives a plain DFlash drafter):
        conv_kernel_size, conv_group_size: two-tap grouped dynamic causal convolution.
        selector_rank, selector_top_k: the candidate selector over the per-position top-k.
    """

    model_type = "dflash2"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 4
    num_attention_heads: int = 9
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    rope_parameters: RopeParameters | dict | None = None
    attention_bias: bool = False
    attention_dropout: float | int = 0.0
    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int | None = None
    layer_types: list[str] | None = None
    use_cache: bool = True
    tie_word_embeddings: bool = False
    is_causal: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    num_target_layers: int | None = None
    target_layer_ids: list[int] | None = None
    block_size: int = 16
    mask_token_id: int | None = None
    conv_kernel_size: int | None = 2
    conv_group_size: int | None = 16
    selector_rank: int | None = 256
    selector_top_k: int | None = 16
    output_multiplier: float | None = None
    final_logit_softcapping: float | None = None
    input_embedding_scale: float | None = None
    target_hidden_reduction: str | None = None
    target_model_type: str | None = None
    target_name_or_path: str | None = None
    draft_vocab_ids: list[int] | None = None
    hybrid_ngram: dict | None = None
    tree_budget: int | str | None = None
    dflash_config: dict | None = None
    auto_map: dict | None = None

    def __post_init__(self, **kwargs):
        # The nested dict (official / SGLang format) fills whatever the top level leaves unset.
        nested = dict(self.dflash_config or {})
        unknown = set(nested) - set(DFLASH_CONFIG_KEYS) - set(ENGINE_DFLASH_CONFIG_KEYS)
        if unknown:
            raise ValueError(
                f"dflash_config has unknown keys {sorted(unknown)}; known keys: {list(DFLASH_CONFIG_KEYS)} "
                f"and the engine keys {list(ENGINE_DFLASH_CONFIG_KEYS)}"
            )
        self._apply_engine_keys({k: nested.pop(k) for k in ENGINE_DFLASH_CONFIG_KEYS if k in nested})
        for key, value in nested.items():
            setattr(self, key, value)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if not self.use_sliding_window:
            self.sliding_window = None
        if self.layer_types is None:
            kind = "sliding_attention" if self.sliding_window else "full_attention"
            self.layer_types = [kind] * self.num_hidden_layers
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": kwargs.pop("rope_theta", 1_000_000.0)}
        if self.target_layer_ids is None and self.num_target_layers is not None:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        if self.target_layer_ids is not None:
            self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if self.auto_map is None:
            self.auto_map = {
                "AutoConfig": "configuration_dflash2.DFlash2Config",
                "AutoModel": "modeling_dflash2.DFlash2DraftModel",
            }
        self.dflash_config = self.nested_dflash_config()
        super().__post_init__(**kwargs)

    def _apply_engine_keys(self, engine: dict) -> None:
        """Map the engines' ``dflash_config`` keys onto this config, or refuse them naming the key."""

        def refuse(key, why):
            raise ValueError(f"dflash_config[{key!r}] = {engine[key]!r}: {why}. Remove the key (or set it to the supported value) to load this drafter here.")

        if engine.get("sample_from_anchor") not in (None, False):
            refuse("sample_from_anchor", "a drafter whose anchor slot samples the next token is another model family; DFlash drafts token anchor+k at slot k (sample_from_anchor=false)")
        if engine.get("is_neox_style") not in (None, True):
            refuse("is_neox_style", "interleaved (GPT-J style) RoPE is not implemented; this drafter uses rotate-half (neox) RoPE")
        if engine.get("attention_sink_bias"):
            refuse("attention_sink_bias", "attention-sink bias is not implemented in this drafter")
        if "causal" in engine and engine["causal"] is not None:
            if not isinstance(engine["causal"], bool):
                refuse("causal", "must be true or false")
            self.is_causal = engine["causal"]
        if engine.get("num_target_layers") is not None:
            if self.num_target_layers not in (None, engine["num_target_layers"]):
                refuse("num_target_layers", f"disagrees with the top-level num_target_layers={self.num_target_layers}")
            self.num_target_layers = int(engine["num_target_layers"])
        window = engine.get("swa_window_size", engine.get("sliding_window"))
        if window in (0, -1):
            window = None
        if window is not None:
            if isinstance(window, bool) or not isinstance(window, int) or window < 1:
                refuse("swa_window_size" if "swa_window_size" in engine else "sliding_window", "the window must be a positive number of tokens")
            if self.use_sliding_window and self.sliding_window not in (None, window):
                refuse("swa_window_size" if "swa_window_size" in engine else "sliding_window",
                       f"differs from the top-level sliding_window={self.sliding_window}")
            self.sliding_window = window
            self.use_sliding_window = True
        if engine.get("use_swa"):
            if self.layer_types is not None and "sliding_attention" not in self.layer_types:
                refuse("use_swa", "layer_types has no sliding_attention layer; name the sliding layers in layer_types")
            if self.sliding_window is None:
                refuse("use_swa", "no window size: set swa_window_size or sliding_window")
            self.use_sliding_window = True
        elif engine.get("use_swa") is False and "sliding_attention" in (self.layer_types or []):
            refuse("use_swa", "layer_types has sliding_attention layers; drop use_swa or set it to true")

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        """An official DFlash 2 checkpoint says ``model_type: qwen3`` (its layers are Qwen3's) beside
        ``architectures: ["DFlash2DraftModel"]`` and a ``dflash_config``: it IS this config, so read it as one
        (transformers would warn that a qwen3 config instantiates a dflash2 model)."""
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if is_official_dflash2_config(config_dict):
            config_dict = {**config_dict, "model_type": cls.model_type}
        return config_dict, kwargs

    def nested_dflash_config(self) -> dict:
        """The ``dflash_config`` dict that SGLang and vLLM read."""
        out = {}
        for key in DFLASH_CONFIG_KEYS:
            value = getattr(self, key)
            if value is None and (key in _OPTIONAL_DFLASH_KEYS or key.startswith(("conv_", "selector_"))):
                continue
            out[key] = value
        if self.is_causal:  # the engines' name for a causal block (never written when false: the default)
            out["causal"] = True
        return out

    def to_dict(self):
        self.dflash_config = self.nested_dflash_config()
        return super().to_dict()

    def hybrid_settings(self) -> dict:
        """``hybrid_ngram`` with the defaults filled in."""
        return {**HYBRID_NGRAM_DEFAULTS, **(self.hybrid_ngram or {})}

    # ---- validation (called by @strict on construction) -------------------------------------------------------

    @property
    def use_conv(self) -> bool:
        return self.conv_kernel_size is not None

    @property
    def use_selector(self) -> bool:
        return self.selector_rank is not None

    def validate_architecture(self):
        """Impossible settings fail here, naming the setting and the fix."""
        if self.hidden_size % self.num_attention_heads and self.head_dim is None:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}; set head_dim")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be at least 2 (the anchor plus one drafted token), got {self.block_size}")
        for a, b in (("conv_kernel_size", "conv_group_size"), ("selector_rank", "selector_top_k")):
            if (getattr(self, a) is None) != (getattr(self, b) is None):
                raise ValueError(f"{a} and {b} go together: set both (DFlash 2) or neither (plain DFlash)")
        if self.use_conv:
            if self.conv_kernel_size < 1:
                raise ValueError(f"conv_kernel_size must be >= 1, got {self.conv_kernel_size}")
            if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be divisible by conv_group_size ({self.conv_group_size}): "
                    "pick a group size that divides the hidden size"
                )
        if self.use_selector:
            if self.selector_rank < 1:
                raise ValueError(f"selector_rank must be >= 1, got {self.selector_rank}")
            if not 1 <= self.selector_top_k <= self.vocab_size:
                raise ValueError(f"selector_top_k must be in [1, vocab_size={self.vocab_size}], got {self.selector_top_k}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size}): "
                "use an unused row of the target's embedding table"
            )
        if self.target_layer_ids is not None:
            if not self.target_layer_ids:
                raise ValueError("target_layer_ids is empty: the drafter needs at least one target layer")
            if self.num_target_layers is not None:
                bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
                if bad:
                    raise ValueError(
                        f"target_layer_ids {bad} are out of range for a target with {self.num_target_layers} layers "
                        f"(valid: 0..{self.num_target_layers - 1})"
                    )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens or None, got {self.sliding_window}")
        if self.final_logit_softcapping is not None and self.final_logit_softcapping <= 0:
            raise ValueError(f"final_logit_softcapping must be > 0 or None, got {self.final_logit_softcapping}")
        if self.target_hidden_reduction is not None and self.target_hidden_reduction not in TARGET_HIDDEN_REDUCTIONS:
            raise ValueError(f"target_hidden_reduction must be one of {TARGET_HIDDEN_REDUCTIONS} or None, got {self.target_hidden_reduction!r}")
        if self.draft_vocab_ids is not None:
            ids = self.draft_vocab_ids
            if len(set(ids)) != len(ids) or not all(0 <= i < self.vocab_size for i in ids):
                raise ValueError(f"draft_vocab_ids must be distinct token ids in [0, vocab_size={self.vocab_size}); set it to None to draft from the full vocabulary")
            if self.use_selector and len(ids) < self.selector_top_k:
                raise ValueError(f"draft_vocab_ids has {len(ids)} tokens, fewer than selector_top_k={self.selector_top_k}: keep at least that many")
        if self.hybrid_ngram is not None:
            unknown = set(self.hybrid_ngram) - set(HYBRID_NGRAM_DEFAULTS)
            if unknown:
                raise ValueError(f"hybrid_ngram has unknown keys {sorted(unknown)}; known keys: {sorted(HYBRID_NGRAM_DEFAULTS)}")
            h = self.hybrid_settings()
            if h["num_tokens"] < 0 or not 1 <= h["min_n"] <= h["max_n"]:
                raise ValueError(f"hybrid_ngram needs num_tokens >= 0 and 1 <= min_n <= max_n, got {h}")
            costs = h["costs"]
            if costs not in (None, "table", "measured") and (
                not isinstance(costs, dict) or set(costs) - {"curve"} != {"multi_token_step", "per_token", "draft"}
                or min(costs[k] for k in ("multi_token_step", "per_token", "draft")) < 0
            ):
                raise ValueError(
                    "hybrid_ngram costs must be None (measured), \"table\", \"measured\" or non-negative "
                    f"multi_token_step, per_token and draft (and optionally a measured curve), got {costs}"
                )
            curve = costs.get("curve") if isinstance(costs, dict) else None
            if curve is not None and not (
                len(curve) >= 2 and all(len(p) == 2 and p[1] >= 0 for p in curve) and all(a[0] < b[0] for a, b in zip(curve, curve[1:]))
            ):
                raise ValueError(f"hybrid_ngram costs curve must be [width, cost] pairs, at least two, widths increasing, "
                                 f"costs non-negative (as costs_dflash2.measure_step_costs writes it), got {curve}")
        budget = self.tree_budget
        if budget is not None and budget != "auto" and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise ValueError(f"tree_budget must be None (one path), \"auto\" (by device) or a node count >= 0, got {budget!r}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for num_hidden_layers={self.num_hidden_layers}")


__all__ = ["DFlash2Config", "HYBRID_NGRAM_DEFAULTS", "default_target_layer_ids"]
