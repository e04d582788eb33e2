"""Two versions of the drafter's code (and weights), side by side in one process: before and after a change.

    git worktree add /tmp/before <rev>
    python -m dflash2_tools.bench_before_after --before /tmp/before --after . --out docs/suffix/before_after.json

Each request of the workload (the repetitive one by default) runs through the plain call of both folders, each with
and without its own suffix index (``noindex`` / ``warm``: the index learns every earlier request of the workload, in
order), one after the other, so CPU drift hits all four alike. Every output is checked against the first one (all
four are the target's greedy text). Reported: medians of per-request speed ratios (to ``before``/``noindex``) and
mean tokens per target forward.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from . import drafter as root
from .benchmark import ForwardCounter, run_method
from .prompts import load_prompt_set
from .target import EMBEDDED_TARGET, load_target

MODES = ("noindex", "warm")


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.target, dtype=torch.float32)
    drafters = {name: root.load_drafter(folder, dtype=torch.float32).eval() for name, folder in (("before", args.before), ("after", args.after))}
    indexes = {}
    for name, drafter in drafters.items():
        index_class = root.suffix_index_class(drafter)
        if index_class is None:
            raise SystemExit(f"the drafter code in {getattr(args, name)} has no suffix index: compare folders from after suffix_dflash2.py")
        indexes[name] = index_class()
    counter = ForwardCounter(target)
    gen_kw = dict(do_sample=False, max_new_tokens=args.max_new_tokens)
    hello = tokenizer.apply_chat_template([{"role": "user", "content": "Hello!"}], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    for drafter in drafters.values():  # warm-up
        drafter.suffix_index = None
        run_method("dflash2+ngram", target, drafter, hello, dict(do_sample=False, max_new_tokens=16), counter)
    rows = []
    for rec in tqdm(load_prompt_set(args.prompt_set)[: args.limit], desc="before/after", unit="request"):
        inputs = tokenizer.apply_chat_template(rec["messages"], add_generation_prompt=True, return_tensors="pt", return_dict=True)
        first = None
        for name, drafter in drafters.items():
            for mode in MODES:
                drafter.suffix_index = indexes[name] if mode == "warm" else None
                out, row = run_method("dflash2+ngram", target, drafter, inputs, gen_kw, counter)
                first = out if first is None else first
                rows.append({"id": rec["id"], "code": name, "mode": mode, "tok_per_s": row["tok_per_s"],
                             "tokens_per_forward": row["acceptance_length"], "per_proposer": row["per_proposer"],
                             "same_as_first": bool(torch.equal(out, first))})
    counter.remove()
    return {"rows": rows, "summary": summarize(rows), "before": str(args.before), "after": str(args.after)}


def summarize(rows: list[dict]) -> list[dict]:
    by: dict[tuple, dict] = {}
    for row in rows:
        by.setdefault((row["code"], row["mode"]), {})[row["id"]] = row
    base = by[("before", "noindex")]
    return [{"code": code, "mode": mode,
             "vs_before_noindex": statistics.median(r["tok_per_s"] / base[i]["tok_per_s"] for i, r in runs.items()),
             "vs_same_code_noindex": statistics.median(r["tok_per_s"] / by[(code, "noindex")][i]["tok_per_s"] for i, r in runs.items()),
             "tokens_per_forward": statistics.mean(r["tokens_per_forward"] for r in runs.values()),
             "same_as_first": sum(r["same_as_first"] for r in runs.values()), "requests": len(runs)}
            for (code, mode), runs in by.items()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="a folder with the drafter's code and weights (e.g. a git worktree)")
    ap.add_argument("--after", default=str(root.REPO_ROOT))
    ap.add_argument("--target", default=EMBEDDED_TARGET)
    ap.add_argument("--prompt-set", default="repetitive")
    ap.add_argument("--limit", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    result = run(args)
    for row in result["summary"]:
        print(f"{row['code']:>6} {row['mode']:>7}: {row['vs_before_noindex']:.3f}x before/noindex, "
              f"{row['vs_same_code_noindex']:.3f}x its own noindex, {row['tokens_per_forward']:.2f} tokens/forward, "
              f"{row['same_as_first']}/{row['requests']} outputs equal")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
