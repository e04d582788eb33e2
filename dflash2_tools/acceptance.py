"""Measure a drafter's acceptance length on held-out prompts through the plain transformers call.

    python -m dflash2_tools.acceptance --prompt-set sharegpt-dev --limit 20

For every prompt: ``target.generate(**chat, assistant_model=drafter, do_sample=False,
max_new_tokens=N, prompt_lookup_num_tokens=0)`` with every drafted token verified; the mean acceptance length is tokens committed per draft-verify target
forward, pooled over all steps of all prompts (and the per-prompt median). Greedy outputs are
checked against the target alone when ``--check`` is given (use fp32 for an exact check). ``--temperature T``
samples instead (exact speculative sampling, T > 0, a fixed seed per prompt): the acceptance of users who sample.

    python -m dflash2_tools.acceptance --tree-budgets 0 4 8 16 32 --cost docs/tree/cost_fp32_avx2.json

measures tree verification at each node budget (0: one path) on the same prompts; with a cost
table from ``dflash2_tools.tree_cost`` it also prints the expected speedup of each budget over
the target alone, acceptance / (verification cost + draft cost), to choose a default budget.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from . import drafter as root
from .prompts import load_prompt_set
from .precision import resolve_dtype
from .target import EMBEDDED_TARGET, load_target


WHOLE_BLOCK = {"costs": {"multi_token_step": 0.0, "per_token": 0.0, "draft": 0.0}}  # the drafter's quality, not the rule's


def measure(target, tokenizer, drafter, records, max_new_tokens=128, check=False, tree_budget=None, temperature=0.0):
    """The block draft alone, every drafted token verified (``prompt_lookup_num_tokens=0`` and a
    cost-free rule): tokens per target forward is then the drafter's acceptance, whatever the
    machine's cost model would choose."""
    gen = root.generation_of(drafter)
    saved = drafter.config.hybrid_ngram, drafter.config.tree_budget
    drafter.config.hybrid_ngram = {**(drafter.config.hybrid_ngram or {}), **WHOLE_BLOCK}
    drafter.config.tree_budget = tree_budget or None
    try:
        return _measure(gen, target, tokenizer, drafter, records, max_new_tokens, check, temperature)
    finally:
        drafter.config.hybrid_ngram, drafter.config.tree_budget = saved


def _measure(gen, target, tokenizer, drafter, records, max_new_tokens, check, temperature=0.0):
    pooled = gen.DFlash2Stats(block_size=drafter.config.block_size)
    per_prompt, mismatches = [], 0
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
    for i, rec in enumerate(tqdm(records, desc="acceptance", unit="prompt")):
        inputs = tokenizer.apply_chat_template(rec["messages"], add_generation_prompt=True, return_tensors="pt", return_dict=True)
        torch.manual_seed(i)  # the same draws for every drafter compared
        out, stats = gen.dflash2_generate(target, drafter, **inputs, **sampling, max_new_tokens=max_new_tokens,
                                          prompt_lookup_num_tokens=0)
        if check and temperature == 0 and not torch.equal(out, target.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)):
            mismatches += 1
        if stats.accept_lengths:
            per_prompt.append(stats.mean_acceptance_length)
        pooled.merge(stats)
    if records and not pooled.accept_lengths:
        raise RuntimeError("no DFlash 2 decoding step was recorded: the drafter's generation code did not run")
    return {
        "prompts": len(records),
        "mean_acceptance_length": pooled.mean_acceptance_length,
        "median_prompt_acceptance_length": statistics.median(per_prompt) if per_prompt else float("nan"),
        "per_position_acceptance": pooled.per_position_acceptance,
        "greedy_mismatches": mismatches if check else None,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=EMBEDDED_TARGET)
    ap.add_argument("--drafter", default=str(root.REPO_ROOT))
    ap.add_argument("--prompt-set", default="sharegpt-dev", help="sharegpt-dev, humaneval, champ or a JSONL file")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"], help="auto: see precision.py")
    ap.add_argument("--check", action="store_true", help="also compare with target-only greedy output")
    ap.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (0: greedy)")
    ap.add_argument("--full-vocab", action="store_true", help="draft from the full LM head, ignoring the drafter's draft_vocab_ids")
    ap.add_argument("--tree-budgets", nargs="*", type=int, default=None, help="tree verification at these node budgets (0: one path)")
    ap.add_argument("--cost", default=None, help="a tree_cost JSON: also print each budget's expected speedup")
    ap.add_argument("--out", default=None, help="write the result JSON here")
    args = ap.parse_args(argv)
    dtype = resolve_dtype(args.dtype)
    args.dtype = str(dtype).removeprefix("torch.")
    target, tokenizer = load_target(args.target, dtype=dtype)
    drafter = root.load_drafter(args.drafter, dtype=dtype).eval()
    if args.full_vocab:
        drafter.config.draft_vocab_ids = None
    records = load_prompt_set(args.prompt_set)[: args.limit]
    if args.temperature < 0:
        ap.error(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    result = {"prompt_set": args.prompt_set, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens, "drafter": args.drafter,
              "temperature": args.temperature,
              "draft_vocab": len(drafter.config.draft_vocab_ids or []) or "full"}
    if args.tree_budgets is None:
        result.update(measure(target, tokenizer, drafter, records, args.max_new_tokens, args.check, temperature=args.temperature))
    else:
        result["trees"] = [{"budget": b, **measure(target, tokenizer, drafter, records, args.max_new_tokens, args.check, b, args.temperature)}
                           for b in args.tree_budgets]
        if args.cost:
            add_expected_speedup(result["trees"], json.loads(open(args.cost).read()), drafter.config.block_size)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


def add_expected_speedup(trees, cost, block_size: int, draft_cost: float = 0.25):
    """Tokens per target forward / (cost of verifying the step's tokens + the draft), both in one-token
    forwards; the verified width is budget + 1 (a tree with its root) or the block (one path).
    ``draft_cost``: the drafter forward, in one-token target forwards (the fp32 CPU cost model's 0.25)."""
    rows = sorted(cost["rows"], key=lambda r: r["nodes"])

    def cost_of(width: int) -> float:  # linear interpolation in the measured table
        for a, b in zip(rows, rows[1:]):
            if a["nodes"] <= width <= b["nodes"]:
                t = (width - a["nodes"]) / max(b["nodes"] - a["nodes"], 1)
                return a["tree_x"] + t * (b["tree_x"] - a["tree_x"])
        return rows[-1]["tree_x"] if width > rows[-1]["nodes"] else rows[0]["tree_x"]

    for tree in trees:
        width = tree["budget"] + 1 if tree["budget"] else block_size
        tree["verify_cost"] = cost_of(width)
        tree["expected_speedup"] = tree["mean_acceptance_length"] / (tree["verify_cost"] + draft_cost)


if __name__ == "__main__":
    main()
