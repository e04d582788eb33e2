"""The engine's own work per step, two versions of the drafter's code side by side in ONE process.

    git worktree add /tmp/before <rev>
    python -m dflash2_tools.bench_engine --before /tmp/before --after . --batch-sizes 1 4 --out docs/engine/ab

Two benchmark runs minutes apart on a shared 2-core VM differ by more than the change being measured (the
target's own speed moved 20% between two runs of one session), so here every batch of every set runs through the
plain call of both versions back to back, in alternating order, after a warm-up batch each. Per run: the engine's
own work per step (each version's suffix index fresh after the warm-up of every set and batch size, then learning
the set's earlier batches as a process would; wall time outside the prefill, the target's verification forwards and drafting, per
verification forward: ``benchmark.engine_ms_per_step``), tokens per target forward and tokens per second; every
output must equal the other version's (both are the target's greedy text). Reported per set and batch size: the
medians over batches of each version, and of the after / before ratios taken batch by batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from . import drafter as root
from .bench_batch import left_padded
from .benchmark import ForwardCounter, engine_ms_per_step
from .prompts import load_prompt_set
from .target import EMBEDDED_TARGET, load_target

VERSIONS = ("before", "after")


def timed_call(target, drafter, inputs, gen_kw, counter) -> tuple[torch.Tensor, dict]:
    """One plain call: its output and (engine ms per step, tokens per forward, tokens per second)."""
    gen = root.generation_of(drafter)
    counter.reset()
    with gen.collect_stats() as runs:
        t0 = time.perf_counter()
        out = target.generate(**inputs, assistant_model=drafter, **gen_kw)
        seconds = time.perf_counter() - t0
    stats, steps = runs[-1], max(counter.calls - 1, 1)
    return out, {"engine_ms": engine_ms_per_step(seconds, counter.first_seconds, counter.seconds, stats.draft_seconds, steps),
                 "tokens_per_forward": stats.new_tokens / steps, "tok_per_s": stats.new_tokens / seconds}


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.target, dtype=torch.float32)
    drafters = {name: root.load_drafter(getattr(args, name), dtype=torch.float32).eval() for name in VERSIONS}
    counter = ForwardCounter(target)
    gen_kw = dict(do_sample=False, max_new_tokens=args.max_new_tokens)
    rows = []
    for prompt_set in args.prompt_sets:
        records = load_prompt_set(prompt_set)[: args.limit]
        for size in args.batch_sizes:
            batches = [left_padded(tokenizer, records[i : i + size]) for i in range(0, len(records), size)]
            for drafter in drafters.values():  # warm-up: kernels, the batch's measured costs
                timed_call(target, drafter, batches[0], gen_kw, counter)
                drafter.suffix_index = root.suffix_index_class(drafter)()  # remembers this set's earlier batches only
            for k, inputs in enumerate(tqdm(batches, desc=f"{prompt_set} batch {size}", unit="batch")):
                order = VERSIONS if k % 2 == 0 else VERSIONS[::-1]
                outs, row = {}, {"set": prompt_set, "batch_size": size, "batch": k}
                for name in order:
                    outs[name], row[name] = timed_call(target, drafters[name], inputs, gen_kw, counter)
                row["same_output"] = bool(torch.equal(outs["before"], outs["after"]))
                rows.append(row)
    counter.remove()
    return {"rows": rows, "summary": summarize(rows), "before": str(args.before), "after": str(args.after)}


def summarize(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["set"], row["batch_size"]), []).append(row)
    out = []
    for (prompt_set, size), runs in groups.items():
        entry = {"set": prompt_set, "batch_size": size, "batches": len(runs), "same_output": sum(r["same_output"] for r in runs)}
        for name in VERSIONS:
            for key in ("engine_ms", "tokens_per_forward", "tok_per_s"):
                entry[f"{name}_{key}"] = statistics.median(r[name][key] for r in runs)
        entry["engine_ms_ratio"] = statistics.median(r["after"]["engine_ms"] / r["before"]["engine_ms"] for r in runs)
        entry["speed_ratio"] = statistics.median(r["after"]["tok_per_s"] / r["before"]["tok_per_s"] for r in runs)
        out.append(entry)
    return out


def table(summary: list[dict]) -> str:
    lines = ["| set | batch | engine ms / step before -> after | ratio (median per batch) | speed after / before | "
             "tokens / forward | outputs equal |", "| --- | ---: | --- | ---: | ---: | --- | --- |"]
    for s in summary:
        lines.append(f"| {s['set']} | {s['batch_size']} | {s['before_engine_ms']:.2f} -> {s['after_engine_ms']:.2f} | "
                     f"{s['engine_ms_ratio']:.2f}x | {s['speed_ratio']:.3f}x | {s['before_tokens_per_forward']:.2f} -> "
                     f"{s['after_tokens_per_forward']:.2f} | {s['same_output']}/{s['batches']} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="a folder with the drafter's code and weights (e.g. a git worktree)")
    ap.add_argument("--after", default=str(root.REPO_ROOT))
    ap.add_argument("--target", default=EMBEDDED_TARGET)
    ap.add_argument("--prompt-sets", nargs="+", default=["champ", "humaneval", "sharegpt-dev"])
    ap.add_argument("--limit", type=int, default=8, help="prompts per set")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="a folder: results.json and results.md")
    args = ap.parse_args(argv)
    if any(size < 1 for size in args.batch_sizes) or args.limit < 1:
        raise SystemExit("--batch-sizes and --limit take positive numbers")
    result = run(args)
    print(table(result["summary"]))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(result, indent=1))
        (args.out / "results.md").write_text(table(result["summary"]) + "\n")


if __name__ == "__main__":
    main()
