"""Exact rollback of stateful (linear-attention) target caches after a partial acceptance.

A verification forward feeds the target ``1 + drafted`` tokens; only the first ``accepted`` stay. Attention K/V (and
a DSA indexer's keys) are cropped by transformers' ``Cache.crop``, a linear-attention layer's conv state too once
past recording is on; its RECURRENT state is not croppable (it absorbed the rejected tokens), which is why
transformers refuses assisted generation for ``_is_stateful`` targets (``qwen3_next``, ``glm5_next``, ...). Per step
(every row of a call commits the same count: ``loop_dflash2``'s lockstep):

    1. before verification: snapshot each linear-attention layer's conv + recurrent state, and arm a pre-hook on
       each linear-attention mixer that records its inputs (normed hidden states, local padding mask)
    2. verification runs unchanged; transformers crops attention K/V and indexer keys
    3. after ``n`` < fed tokens are accepted: restore the snapshots and rerun each mixer on its recorded inputs for
       the first ``n`` positions only (its projections, short conv and recurrence: no second target forward)

Exact: the mixer inputs at accepted positions depend only on earlier tokens (every other layer is causal), so the
replay gives the state of a target that only saw the accepted tokens, through the model's own code and kernels.
"""

from __future__ import annotations

import inspect
import time
import weakref

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin


def linear_attention_mixers(target) -> dict[int, torch.nn.Module]:
    """``{layer_idx: module}`` for the target's linear-attention token mixers.

    A mixer is a module with a ``layer_idx`` whose forward takes ``cache_params`` (the
    transformers convention of qwen3_next, glm5_next, kimi_linear, ...) on a layer the config
    marks ``linear_attention``.
    """
    layer_types = getattr(target.config.get_text_config(), "layer_types", None) or []
    linear_ids = {i for i, kind in enumerate(layer_types) if kind == "linear_attention"}
    mixers = {}
    for module in target.modules():
        idx = getattr(module, "layer_idx", None)
        if idx in linear_ids and "cache_params" in inspect.signature(module.forward).parameters:
            mixers[idx] = module
    return mixers


def check_rollback_supported(target) -> dict[int, torch.nn.Module]:
    """The target's linear-attention mixers; a clear error when it has state we cannot roll back."""
    layer_types = getattr(target.config.get_text_config(), "layer_types", None) or []
    kinds = set(layer_types) - {"full_attention", "indexed_attention", "sliding_attention", "linear_attention"}
    mixers = linear_attention_mixers(target)
    missing = {i for i, k in enumerate(layer_types) if k == "linear_attention"} - set(mixers)
    if not layer_types:
        what = "no layer_types in its config"
    elif kinds:
        what = f"layer types {sorted(kinds)}"
    elif missing:
        what = f"linear-attention layers {sorted(missing)} without a cache_params mixer"
    else:
        return mixers
    raise ValueError(
        f"DFlash 2 cannot roll back the state of {type(target).__name__} ({what}): "
        "only attention, DSA-indexed attention and linear-attention (conv + recurrent state) layers are supported"
    )


class LinearStateRollback:
    """Snapshot / record / replay for one generation. Hooks are removed when ``owner`` is collected."""

    def __init__(self, target, owner):
        self.mixers = check_rollback_supported(target)
        self.armed = False
        self.recorded: dict[int, dict] = {}
        self.snapshots: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        self.seconds = 0.0  # snapshot + replay wall time, for the stats
        handles = [m.register_forward_pre_hook(self._record, with_kwargs=True) for m in self.mixers.values()]
        weakref.finalize(owner, _remove_all, handles)

    def _record(self, module, args, kwargs):
        if self.armed:
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            self.recorded[module.layer_idx] = {**kwargs, "hidden_states": hidden}
        return None

    def pad_conv_windows(self, cache) -> None:
        """Call before every target forward after the prefill, whatever the step verifies.

        A prompt shorter than the conv kernel leaves a short window under past recording (transformers
        pads it only when it does not record); its missing history is zeros (what the conv's own padding
        means), and the 1-token decode kernel of a plain step needs the full window.
        """
        for idx in self.mixers:
            layer = cache.layers[idx]
            if not isinstance(layer, LinearAttentionCacheLayerMixin):
                raise TypeError(f"layer {idx} of the target cache is {type(layer).__name__}, not a linear-attention cache layer")
            conv, width = layer.conv_states[0], layer.conv_kernel_size[0]
            if conv is not None and conv.shape[-1] < width:
                layer.conv_states[0] = torch.nn.functional.pad(conv, (width - conv.shape[-1], 0))

    def begin_step(self, cache) -> None:
        """Call right before the verification forward."""
        t0 = time.perf_counter()
        self.pad_conv_windows(cache)
        self.snapshots = {}
        for idx in self.mixers:
            layer = cache.layers[idx]
            conv, rec = layer.conv_states[0], layer.recurrent_states[0]
            self.snapshots[idx] = (
                None if conv is None else conv.clone(),
                None if rec is None else rec.clone(),
            )
        self.recorded = {}
        self.armed = True
        self.seconds += time.perf_counter() - t0

    @torch.no_grad()
    def finish_step(self, accepted: int, fed: int) -> None:
        """After transformers cropped the cache: make linear layers hold exactly ``accepted`` of ``fed`` tokens."""
        self.armed = False
        if accepted >= fed or not self.recorded:
            self.recorded = {}
            return
        t0 = time.perf_counter()
        for idx, module in self.mixers.items():
            inputs = self.recorded[idx]
            cache = inputs["cache_params"]
            layer = cache.layers[idx]
            conv, rec = self.snapshots[idx]
            if conv is not None:
                layer.conv_states[0] = conv
            if rec is not None:
                layer.recurrent_states[0].copy_(rec)  # in place: the cache may hold a static address
            replay = dict(inputs)
            replay["hidden_states"] = inputs["hidden_states"][:, :accepted]  # [b, accepted, H]
            mask = inputs.get("attention_mask")
            if isinstance(mask, torch.Tensor) and mask.dim() == 2:
                replay["attention_mask"] = mask[:, :accepted]  # local padding mask of the fed tokens
            module(**replay)
            if layer.record_past:
                layer.crop(0)  # back to the kernel-size conv window the next forward extends
        self.recorded = {}
        self.seconds += time.perf_counter() - t0


def _remove_all(handles) -> None:
    for handle in handles:
        handle.remove()


__all__ = ["LinearStateRollback", "check_rollback_supported", "linear_attention_mixers"]
