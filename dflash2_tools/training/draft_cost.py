"""What a drafter's draft costs per step through the plain call, for drafters of different sizes side by side.

    python -m dflash2_tools.training.draft_cost --drafters runs/levers/current-recipe-3-layers-block-8/checkpoint \\
        runs/levers/4-layers/checkpoint runs/levers/5-layers/checkpoint . --out docs/training/draft_cost.json

Every drafter drafts its whole block at every step (``num_assistant_tokens = B - 1``, no n-gram continuation) for
the same prompt and 64 new tokens, greedy, fp32, after a warm-up call; reported: the median over 3 calls of the
proposer's own drafting time per step (the drafter forward, its head, the selector's walk), beside the drafter's
parameters. A drafter's acceptance gain pays only if it beats its extra draft cost against the whole step's cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from .. import drafter as root
from ..card import machine_info
from ..target import EMBEDDED_TARGET, load_target

PROMPT = "Write a python function that merges two sorted lists, with tests. " * 6


def draft_ms_per_step(target, inputs, drafter, path: str, calls: int = 3, new_tokens: int = 64) -> float:
    drafter.config.hybrid_ngram = {**drafter.config.hybrid_settings(), "num_tokens": 0}  # the block draft alone
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, assistant_model=drafter,
              num_assistant_tokens=drafter.config.block_size - 1)
    target.generate(**inputs, **kw)  # warm-up
    per_step = []
    for _ in range(calls):
        with root.generation(path).collect_stats() as runs:  # the drafter's own code collects its statistics
            target.generate(**inputs, **kw)
        stats = runs[-1]
        per_step.append(1e3 * stats.draft_seconds / max(stats.forwards, 1))
    return statistics.median(per_step)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", nargs="+", required=True, help="drafter folders or training checkpoints")
    ap.add_argument("--target", default=EMBEDDED_TARGET)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.target, dtype=torch.float32)
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    rows = []
    for path in args.drafters:
        drafter = root.load_drafter(path, dtype=torch.float32).eval()
        rows.append({"drafter": path, "layers": drafter.config.num_hidden_layers, "block_size": drafter.config.block_size,
                     "params_millions": sum(p.numel() for p in drafter.parameters()) / 1e6,
                     "draft_ms_per_step": draft_ms_per_step(target, inputs, drafter, path)})
        print(f"{path}: {rows[-1]['layers']} layers, {rows[-1]['params_millions']:.2f}M params, "
              f"{rows[-1]['draft_ms_per_step']:.2f} ms per draft", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows, "machine": machine_info(), "threads": args.threads}, indent=1))


if __name__ == "__main__":
    main()
