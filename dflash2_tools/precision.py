"""Pick bf16 only where it is fast.

Measured on a 2-core AVX2-only EPYC (no native bf16; matmuls are emulated): bf16 made
multi-token work slower than fp32 -- a SmolLM2-135M forward over 4 x 300 tokens 61 s vs 10.5 s,
a drafter training step 80 s vs 2.9 s -- and an 8-token verification forward no faster (~200 ms
vs ~190 ms), while one-token decoding got faster (~60 ms vs ~110 ms: half the weight bytes).
Training and speculative decoding are multi-token work, so ``auto`` means fp32 on such CPUs.
On CPUs with AVX-512 bf16 / AMX and on GPUs bf16 is the faster choice (an earlier session's
machine trained at ~1 s/step in bf16).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from . import drafter as root


@lru_cache(maxsize=None)
def bf16_is_fast(device: str = "cpu") -> bool:
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return root.generation().cpu_has_native_bf16()  # the same test the generation cost model uses


def resolve_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """``"auto"`` -> bfloat16 where it is fast on ``device``, else float32; other names as given."""
    if name == "auto":
        return torch.bfloat16 if bf16_is_fast(device) else torch.float32
    return getattr(torch, name)
