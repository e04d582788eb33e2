"""Calibrate the hybrid n-gram rule on data: which proposal to verify at each step.

    python -m dflash2_tools.calibrate_hybrid --prompt-sets sharegpt-train humaneval champ --offset 20 --limit 6 --out docs/hybrid/calibration.json

Greedy generation with the block draft verified at every step, while the n-gram proposer
runs beside it (``trace_proposals``). The target's greedy output is fixed, so after the call
both proposals of every step are scored counterfactually: accepted = common prefix with what
the target actually produced from that position. From these steps:

* ``ngram_acceptance[m]``: per-token acceptance of an n-gram continuation with match length m
  (geometric MLE: accepted tokens / (accepted tokens + first rejections));
* ``drafter_acceptance``: the block draft's mean P(position i accepted), which decides before
  drafting whether a draft is worth its forward;
* ``drafter_scale`` and ``ngram_margin``: grid search for the rule that commits the most
  tokens per unit of cost over the traced steps, replayed step by step with the rule itself:
  the drafter runs only where the rule would run it (costing ``--costs`` draft), a proposal cut
  to L tokens commits ``min(accepted, L) + 1`` and costs ``1 + multi_token_step + per_token * L``
  one-token forwards (a plain step 1).

``--from-trace FILE`` refits from a saved trace (e.g. for other ``--costs``) without
generating again.

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


def replay(steps: list[dict], rule, ngram, policy: str = "rule") -> dict:
    """Tokens per step and per unit of cost of a policy over traced steps (greedy counterfactuals).

    policy "rule": the hybrid rule as generation runs it; "dflash2": the drafter every step, cut by
    the rule; "ngram": the whole n-gram continuation when there is one, else a plain step
    (prompt lookup)."""
    tokens = cost = 0.0
    last_position = None
    for s in steps:
        if last_position is None or s["position"] <= last_position:  # a new prompt: a new call
            rule.outcomes = {"dflash2": [0.0, 0.0], "ngram": [0.0, 0.0]}
        last_position = s["position"]
        match = ngram.NgramMatch(s["ngram"], s["match_length"]) if s["ngram"] else None
        if policy == "ngram":
            choice, rates = (ngram.Proposal("ngram", len(s["ngram"])) if match else ngram.Proposal("none", 0)), []
        else:
            drafts = policy == "dflash2" or ngram.draft_pays([rule], [match], [len(s["draft"])], rule.costs)
            cost += rule.costs.draft if drafts else 0.0
            choice = rule.choose(None if policy == "dflash2" else match, s["confidence"] if drafts else None)
            rates = rule.ngram_rates(match) if choice.proposer == "ngram" else rule.drafter_rates(s["confidence"])
        accepted = {"ngram": s["ngram_accepted"], "dflash2": s["draft_accepted"], "none": 0}[choice.proposer]
        accepted = min(accepted, choice.length)
        rule.record(choice, rates, accepted)
        tokens += accepted + 1
        cost += rule.costs.verify(choice.length)
    return {"tokens_per_step": tokens / max(len(steps), 1), "tokens_per_cost": tokens / max(cost, 1e-9)}


def fit_drafter_acceptance(steps: list[dict]) -> list[float]:
    """Mean P(block position i accepted) of the whole block draft."""
    if not steps:
        raise ValueError("no traced steps: the calls verified no block draft (trace_proposals records one-path steps only)")
    n = max(len(s["draft"]) for s in steps)
    return [round(sum(s["draft_accepted"] > i for s in steps) / len(steps), 3) for i in range(n)]


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
    ap.add_argument("--costs", type=float, nargs=3, default=[0.65, 0.035, 0.25], metavar=("MULTI_TOKEN_STEP", "PER_TOKEN", "DRAFT"),
                    help="a step's costs in one-token forwards (default: fp32 on a 2-core AVX2 CPU, "
                    "costs_dflash2.table_step_costs; a GPU: 0 0 0.1)")
    ap.add_argument("--from-trace", default=None, help="refit from this saved --out file instead of generating")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    if args.from_trace:
        saved = json.load(open(args.from_trace))
        steps, settings = saved["trace"], {k: v for k, v in saved["hybrid_ngram"].items() if k != "verify_cost_per_token"}
        ngram = root.ngram_of(root.load_drafter(args.drafter))
    else:
        steps, settings, ngram = trace(args)
    costs = ngram.StepCosts(*args.costs)
    rule = ngram.HybridRule(fit_ngram_acceptance(steps, settings["max_n"]), 1.0, 0.0, fit_drafter_acceptance(steps), costs)
    grid = []
    for scale, margin in itertools.product([0.6, 0.7, 0.8, 0.9, 1.0, 1.2], [-0.5, -0.25, 0.0, 0.25, 0.5]):
        rule.drafter_scale, rule.ngram_margin = scale, margin
        grid.append((replay(steps, rule, ngram)["tokens_per_cost"], scale, margin))
    _, rule.drafter_scale, rule.ngram_margin = max(grid)
    fit = {**settings, "ngram_acceptance": rule.ngram_acceptance, "drafter_acceptance": rule.drafter_acceptance,
           "drafter_scale": rule.drafter_scale, "ngram_margin": rule.ngram_margin, "costs": None}
    summary = {"steps": len(steps), "costs": vars(costs), "hybrid_ngram": fit, "replay": {}}
    for name in [*sorted({s["prompt_set"] for s in steps}), "all"]:
        subset = [s for s in steps if name in ("all", s["prompt_set"])]
        summary["replay"][name] = {policy: replay(subset, rule, ngram, policy) for policy in ("dflash2", "ngram", "rule")}
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**summary, "args": vars(args), "trace": steps}, f)


def trace(args):
    """Greedy generation on the prompt sets, tracing both proposals at every step (block draft verified)."""
    dtype = resolve_dtype(args.dtype)
    target, tokenizer = load_target(args.target, dtype=dtype)
    drafter = root.load_drafter(args.drafter, dtype=dtype).eval()
    gen = root.generation_of(drafter)
    settings = drafter.config.hybrid_settings()
    # trace both, always verify the whole block draft
    drafter.config.hybrid_ngram = {**settings, "ngram_margin": -1e9, "costs": {"multi_token_step": 0.0, "per_token": 0.0, "draft": 0.0}}
    drafter.config.tree_budget = None  # one path per step: under free costs "auto" would verify trees, which are not traced
    steps = []
    for name in args.prompt_sets:
        records = sharegpt_prompts("train") if name == "sharegpt-train" else load_prompt_set(name)
        if name == "sharegpt-train":
            random.Random(1).shuffle(records)  # not the regenerated data's order
        for rec in tqdm(records[args.offset : args.offset + args.limit], desc=f"tracing {name}", unit="prompt"):
            inputs = tokenizer.apply_chat_template(rec["messages"], add_generation_prompt=True, return_tensors="pt", return_dict=True)
            with gen.trace_proposals() as steps_of_call:
                out = target.generate(**inputs, assistant_model=drafter, do_sample=False, max_new_tokens=args.max_new_tokens)
            steps += [{**s, "prompt_set": name} for s in scored_steps(steps_of_call, out[0].tolist())]
    return steps, settings, root.ngram_of(drafter)


if __name__ == "__main__":
    main()
