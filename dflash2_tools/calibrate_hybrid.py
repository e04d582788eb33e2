"""Calibrate the hybrid n-gram rule on data: which proposal to verify at each step.

    python -m dflash2_tools.calibrate_hybrid --prompt-sets sharegpt-train humaneval champ --offset 20 --limit 6

Greedy generation with the block draft verified at every step, while the n-gram proposer
runs beside it (``trace_proposals``). The target's greedy output is fixed, so after the call
both proposals of every step are scored counterfactually: accepted = common prefix with what
the target actually produced from that position. From these steps:

* ``ngram_acceptance[m]``: per-token acceptance of an n-gram continuation with match length m
  (geometric MLE: accepted tokens / (accepted tokens + first rejections));
* ``drafter_scale`` and ``ngram_margin``: grid search for the rule that commits the most
  tokens per step over the traced steps.

Evaluation sets are used past ``--offset`` only (the benchmark takes their first prompts).
Prints the fitted ``hybrid_ngram`` dict (for config.json), tokens per step for drafter-only,
n-gram-first and the fitted rule, and writes it all to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random

from tqdm import tqdm

from . import drafter as root
from .precision import resolve_dtype
from .prompts import load_prompt_set, sharegpt_prompts
from .target import EMBEDDED_TARGET, load_target


def common_prefix(proposal: list[int], truth: list[int]) -> int:
    n = 0
    for a, b in zip(proposal, truth):
        if a != b:
            break
        n += 1
    return n


def scored_steps(trace: list[dict], output: list[int]) -> list[dict]:
    """Each traced step with the counterfactual accepted count of both proposals."""
    out = []
    for step in trace:
        truth = output[step["position"] :]
        out.append({**step, "draft_accepted": common_prefix(step["draft"], truth), "ngram_accepted": common_prefix(step["ngram"], truth)})
    return out


def fit_ngram_acceptance(steps: list[dict], max_n: int) -> list[float]:
    """Per-token acceptance by match length (index 0 unused: no match)."""
    table = [0.0]
    for m in range(1, max_n + 1):
        hits = [s for s in steps if s["match_length"] == m and s["ngram"]]
        accepted = sum(s["ngram_accepted"] for s in hits)
        rejections = sum(s["ngram_accepted"] < len(s["ngram"]) for s in hits)
        table.append(round(accepted / (accepted + rejections), 3) if accepted + rejections else 0.0)
    return table


def tokens_per_step(steps: list[dict], choose) -> float:
    """Committed tokens per verification (accepted + the bonus token) when ``choose(step)`` picks the n-gram."""
    return sum((s["ngram_accepted"] if choose(s) else s["draft_accepted"]) + 1 for s in steps) / max(len(steps), 1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=EMBEDDED_TARGET)
    ap.add_argument("--drafter", default=str(root.REPO_ROOT))
    ap.add_argument("--prompt-sets", nargs="+", default=["sharegpt-train", "humaneval", "champ"],
                    help="sharegpt-train (training prompts), or any benchmark set (then only past --offset)")
    ap.add_argument("--offset", type=int, default=20, help="skip this many prompts of each set (the benchmark's)")
    ap.add_argument("--limit", type=int, default=6, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    dtype = resolve_dtype(args.dtype)
    target, tokenizer = load_target(args.target, dtype=dtype)
    drafter = root.load_drafter(args.drafter, dtype=dtype).eval()
    gen = root.generation_of(drafter)
    settings = drafter.config.hybrid_settings()
    drafter.config.hybrid_ngram = {**settings, "ngram_margin": -1e9}  # trace both, always verify the block draft

    steps = []
    for name in args.prompt_sets:
        records = sharegpt_prompts("train") if name == "sharegpt-train" else load_prompt_set(name)
        if name == "sharegpt-train":
            random.Random(1).shuffle(records)  # not the regenerated data's order
        for rec in tqdm(records[args.offset : args.offset + args.limit], desc=f"tracing {name}", unit="prompt"):
            inputs = tokenizer.apply_chat_template(rec["messages"], add_generation_prompt=True, return_tensors="pt", return_dict=True)
            with gen.trace_proposals() as trace:
                out = target.generate(**inputs, assistant_model=drafter, do_sample=False, max_new_tokens=args.max_new_tokens)
            steps += [{**s, "prompt_set": name} for s in scored_steps(trace, out[0].tolist())]

    table = fit_ngram_acceptance(steps, settings["max_n"])
    ngram = root.ngram_of(drafter)
    rule = ngram.HybridRule(table, 1.0, 0.0)
    grid = []
    for scale, margin in itertools.product([0.6, 0.8, 1.0, 1.2, 1.5, 2.0], [-1.0, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0]):
        rule.drafter_scale, rule.ngram_margin = scale, margin
        grid.append((tokens_per_step(steps, lambda s: rule.use_ngram(_match(ngram, s), s["confidence"])), scale, margin))
    best, scale, margin = max(grid)
    fitted = {**settings, "ngram_acceptance": table, "drafter_scale": scale, "ngram_margin": margin}
    rule.drafter_scale, rule.ngram_margin = scale, margin
    summary = {"steps": len(steps), "hybrid_ngram": fitted, "tokens_per_step": {}}
    for name in [*args.prompt_sets, "all"]:
        subset = [s for s in steps if name in ("all", s["prompt_set"])]
        summary["tokens_per_step"][name] = {
            "dflash2": tokens_per_step(subset, lambda s: False),
            "ngram_when_matched": tokens_per_step(subset, lambda s: bool(s["ngram"])),
            "oracle": sum(max(s["ngram_accepted"], s["draft_accepted"]) + 1 for s in subset) / max(len(subset), 1),
            "fitted_rule": tokens_per_step(subset, lambda s: rule.use_ngram(_match(ngram, s), s["confidence"])),
        }
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**summary, "args": vars(args), "trace": steps}, f)


def _match(ngram, step):
    return ngram.NgramMatch(step["ngram"], step["match_length"]) if step["ngram"] else None


if __name__ == "__main__":
    main()
