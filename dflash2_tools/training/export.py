"""Export a training checkpoint to a Hub-ready drafter folder (the repository root by default).

    python -m dflash2_tools.training.export --checkpoint runs/smollm2/checkpoint

Writes ``model.safetensors`` (official tensor names, bf16, no target weights),
``config.json`` (top-level + nested ``dflash_config``, ``auto_map``) and the target's
tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, chat template), so the
folder works with ``AutoModel.from_pretrained(..., trust_remote_code=True)``, SGLang and vLLM.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch

from .. import drafter as root
from ..target import EMBEDDED_TARGET, resolve_target

EXPORTED = ("config.json", "model.safetensors")


def export(checkpoint: str | Path, out: str | Path = root.REPO_ROOT, target: str | None = EMBEDDED_TARGET, dtype=torch.bfloat16) -> Path:
    from transformers import AutoTokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = root.load_drafter(checkpoint, dtype=torch.float32).to(dtype)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        for name in EXPORTED:
            shutil.copyfile(Path(tmp) / name, out / name)
        if out.resolve() != root.REPO_ROOT.resolve():  # a standalone folder also needs the code
            for py in root.REMOTE_CODE_FILES:
                shutil.copyfile(root.REPO_ROOT / py, out / py)
            shutil.copytree(root.REPO_ROOT / "custom_generate", out / "custom_generate", dirs_exist_ok=True)
    if target is not None:
        AutoTokenizer.from_pretrained(resolve_target(target)).save_pretrained(out)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--out", default=str(root.REPO_ROOT))
    ap.add_argument("--target", default=EMBEDDED_TARGET, help="whose tokenizer files to ship (None: skip)")
    args = ap.parse_args(argv)
    print(export(args.checkpoint, args.out, None if args.target == "None" else args.target))


if __name__ == "__main__":
    main()
