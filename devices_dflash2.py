"""Where the target's modules live and compute, for targets placed by a ``device_map``.

A target loaded with ``device_map="auto"`` is sharded over devices; one with "cpu"/"disk" entries is
offloaded by accelerate: those modules keep their weights on ``meta`` and a hook loads them for each
forward. The drafter talks to three parts of the target -- the embedding table (block inputs), the
layers it taps (context features) and the LM head (draft logits) -- so it reads weights only through
``module_weights`` and asks ``execution_device`` where a module computes.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def has_offloaded_weights(module: nn.Module) -> bool:
    """True when accelerate keeps this module's own weights off-device (``meta``) until its hook loads them."""
    return getattr(module, "_hf_hook", None) is not None and any(
        p.device.type == "meta" for p in module.parameters(recurse=False)
    )


@contextlib.contextmanager
def module_weights(module: nn.Module):
    """Inside: the module's own weights are real tensors on its execution device, even when accelerate
    offloaded them (``device_map`` with "cpu"/"disk" entries) -- read weights only inside this."""
    if not has_offloaded_weights(module):
        yield
        return
    from accelerate.utils import align_module_device  # only offloaded modules need it, and they come from accelerate

    with align_module_device(module):
        yield


def execution_device(module: nn.Module) -> torch.device:
    """Where a target module computes: its accelerate hook's execution device, else its weights' device."""
    hook_device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if hook_device is not None:
        return torch.device(hook_device if not isinstance(hook_device, int) else f"cuda:{hook_device}")
    return next(p.device for p in module.parameters())


__all__ = ["execution_device", "has_offloaded_weights", "module_weights"]
