"""Suffix drafting, measured: the plain call with and without the drafter's index over earlier calls' outputs.

    python -m dflash2_tools.bench_suffix --out docs/suffix

One process, greedy, requests in the workload's order, every method on every request before the next request (so
CPU drift hits all alike), each method holding ITS OWN index (what a user running only that method would have):

* ``target``: the target alone; ``pld``: transformers' prompt lookup (``prompt_lookup_num_tokens=10``)
* ``plain-noindex``: ``target.generate(..., assistant_model=drafter)`` with ``drafter.suffix_index = None``
* ``plain-cold``: an empty index at every request (what the index costs when it has nothing)
* ``plain-warm``: one index that learns every earlier request's output, in order (the default behaviour)
* ``plain-seeded``: the same, seeded first with the target's regenerated training responses (``--seed-data``)

``--sets`` also runs the held-out sets (HumanEval, CHAMP, ShareGPT-dev: ``plain-noindex`` against ``plain-warm``).
Every output is checked against the target's greedy output; the target's answers to the repetitive workload are kept
in ``results.json``. Speedups are medians of per-request ratios to the target alone, tokens per forward beside them.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from . import drafter as root
from .benchmark import ForwardCounter, run_method
from .card import machine_info
from .prompts import load_prompt_set
from .regenerate import load_chunks
from .target import EMBEDDED_TARGET, load_target

METHODS = ("target", "pld", "plain-noindex", "plain-cold", "plain-warm", "plain-seeded")
HELD_OUT_METHODS = ("target", "plain-noindex", "plain-warm")
SEED_DATA = ["data/smollm2-sharegpt-turns-128", "data/smollm2-sharegpt-code-math-128", "data/smollm2-python-stubs-128",
             "data/smollm2-school-math-128"]


def seeded_index(SuffixIndex, folders: list[str], max_tokens: int):
    """An index holding the regenerated responses of ``folders`` (each after its prompt's tail), oldest first."""
    index = SuffixIndex(max_tokens=max_tokens)
    for tokens, prompt_length in load_chunks([f for f in folders if Path(f).is_dir()]):
        index.add(tokens[prompt_length:].tolist(), tokens[:prompt_length].tolist())
    return index


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.target, dtype=torch.float32)
    drafter = root.load_drafter(args.drafter, dtype=torch.float32).eval()
    counter = ForwardCounter(target)
    SuffixIndex = root.suffix_index_class(drafter)
    if SuffixIndex is None:
        raise SystemExit(f"the drafter at {args.drafter} has no suffix index (its code predates suffix_dflash2.py): "
                         "export it with the current code, or benchmark the repository's drafter")
    t0 = time.perf_counter()
    seeded = seeded_index(SuffixIndex, args.seed_data, args.seed_max_tokens)
    seed_seconds, seeded_tokens = time.perf_counter() - t0, len(seeded)
    indexes = {"plain-warm": SuffixIndex(), "plain-seeded": seeded}
    sets = {"repetitive": load_prompt_set("repetitive")[: args.limit]}
    sets.update({name: load_prompt_set(name)[: args.held_out_limit] for name in args.sets})
    warm = tokenizer.apply_chat_template([{"role": "user", "content": "Hello!"}], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    for method in ("target", "pld", "plain-noindex"):  # warm-up, with a throwaway index
        drafter.suffix_index = SuffixIndex() if method == "plain-noindex" else None
        run_method("dflash2+ngram" if method.startswith("plain") else method, target, drafter, warm, dict(do_sample=False, max_new_tokens=16), counter)
    rows, answers = [], {}
    bar = tqdm(total=sum(len(v) * len(args.methods if k == "repetitive" else HELD_OUT_METHODS) for k, v in sets.items()), desc="bench_suffix", unit="call")
    for set_name, records in sets.items():
        methods = args.methods if set_name == "repetitive" else HELD_OUT_METHODS
        if set_name != "repetitive":
            indexes["plain-warm"] = SuffixIndex()  # each held-out set learns from its own earlier prompts only
        for rec in records:
            inputs = tokenizer.apply_chat_template(rec["messages"], add_generation_prompt=True, return_tensors="pt", return_dict=True)
            reference = None
            for method in methods:
                drafter.suffix_index = {"plain-noindex": None, "plain-cold": SuffixIndex()}.get(method, indexes.get(method))
                out, row = run_method("dflash2+ngram" if method.startswith("plain") else method, target, drafter, inputs,
                                      dict(do_sample=False, max_new_tokens=args.max_new_tokens), counter)
                if method == "target":
                    reference = out
                    if set_name == "repetitive":
                        answers[rec["id"]] = out[0, inputs["input_ids"].shape[1]:].tolist()
                row.update(prompt_set=set_name, prompt_id=rec["id"], method=method, same_as_target=bool(torch.equal(out, reference)),
                           indexed_tokens=len(drafter.suffix_index) if drafter.suffix_index is not None else 0)
                for key in ("per_position_acceptance", "accept_lengths", "costs"):
                    row.pop(key, None)
                rows.append(row)
                bar.update(1)
    bar.close()
    counter.remove()
    return {"rows": rows, "summary": summarize(rows), "answers": answers, "seed_seconds": seed_seconds,
            "seeded_tokens": seeded_tokens, "machine": machine(args)}


def index_scaling(sizes: list[int], lookups: int = 2000, seed: int = 0) -> list[dict]:
    """Median microseconds per lookup and tokens read, with the index filled to each size (random text over a
    2,000-token vocabulary, so many contexts match; the looked-up contexts are drawn from the same text)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    SuffixIndex = root.modeling().SuffixIndex
    out = []
    for size in tqdm(sizes, desc="index sizes"):
        index = SuffixIndex(max_tokens=size)
        t0 = time.perf_counter()
        for _ in range(max(1, size // 100_000)):
            index.add(rng.integers(0, 2000, min(size - 1, 100_000)).tolist())
        fill_seconds = time.perf_counter() - t0
        contexts = [index.ring[(s + np.arange(8)) % size].tolist() for s in rng.integers(0, min(index.total, size) - 8, lookups)]
        times, found = [], 0
        for context in contexts:
            t = time.perf_counter()
            trie = index.lookup(context)
            times.append(time.perf_counter() - t)
            found += trie is not None
        out.append({"indexed_tokens": len(index), "median_lookup_us": 1e6 * statistics.median(times),
                    "p90_lookup_us": 1e6 * sorted(times)[int(0.9 * len(times))], "found": found / lookups,
                    "fill_seconds": fill_seconds, "nbytes": index.nbytes})
    return out


def machine(args) -> dict:
    return {**machine_info(), "threads": args.threads, "dtype": "float32", "max_new_tokens": args.max_new_tokens}


def median_ratio(rows: list[dict], by: dict, other: str) -> float | None:
    """Median over ``rows`` of tok/s against the same request's ``other`` method."""
    pairs = [r["tok_per_s"] / by[key]["tok_per_s"] for r in rows if (key := (r["prompt_set"], r["prompt_id"], other)) in by]
    return statistics.median(pairs) if pairs else None


def summarize(rows: list[dict]) -> list[dict]:
    """Per set and method: median speedup over the target (per-request ratios), tokens per forward, lossless count,
    and the medians of per-request ratios to ``plain-noindex`` and ``pld`` (same requests)."""
    by = {(r["prompt_set"], r["prompt_id"], r["method"]): r for r in rows}
    out = []
    for set_name in dict.fromkeys(r["prompt_set"] for r in rows):
        for method in dict.fromkeys(r["method"] for r in rows if r["prompt_set"] == set_name):
            rs = [r for r in rows if r["prompt_set"] == set_name and r["method"] == method]
            ratio = functools.partial(median_ratio, rs, by)

            suffix = [c for r in rs for name, c in (r.get("per_proposer") or {}).items() if name == "suffix"]
            out.append({"prompt_set": set_name, "method": method, "requests": len(rs),
                        "median_tok_per_s": statistics.median(r["tok_per_s"] for r in rs), "speedup_vs_target": ratio("target"),
                        "vs_plain_noindex": ratio("plain-noindex"), "vs_pld": ratio("pld"),
                        "tokens_per_forward": statistics.mean(r["acceptance_length"] for r in rs),
                        "suffix_steps": sum(c["steps"] for c in suffix), "suffix_accepted": sum(c["accepted"] for c in suffix),
                        "lossless": f"{sum(r['same_as_target'] for r in rs)}/{len(rs)}"})
    return out


def markdown(summary: list[dict]) -> str:
    def fmt(x):
        return "" if x is None else f"{x:.2f}x"

    lines = ["| set | method | requests | tok/s | vs target | vs plain w/o index | vs prompt lookup | tokens/forward | suffix steps (accepted) | greedy == target |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['prompt_set']} | {r['method']} | {r['requests']} | {r['median_tok_per_s']:.1f} | {fmt(r['speedup_vs_target'])} | "
              f"{fmt(r['vs_plain_noindex'])} | {fmt(r['vs_pld'])} | {r['tokens_per_forward']:.2f} | {r['suffix_steps']} ({r['suffix_accepted']}) | "
              f"{r['lossless']} |" for r in summary]
    return "\n".join(lines) + "\n"


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(dict.fromkeys(r["prompt_set"] for r in summary))
    fig, axes = plt.subplots(1, len(sets), figsize=(4.5 * len(sets), 3.6), squeeze=False)
    for ax, set_name in zip(axes[0], sets):
        rs = [r for r in summary if r["prompt_set"] == set_name]
        ax.bar([r["method"] for r in rs], [r["speedup_vs_target"] for r in rs], color="#4a7ab7")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(set_name)
        ax.set_ylabel("median speedup over the target")
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=EMBEDDED_TARGET)
    ap.add_argument("--drafter", default=str(root.REPO_ROOT))
    ap.add_argument("--limit", type=int, default=48, help="requests of the repetitive workload (in order)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS,
                    help="methods on the repetitive workload (target first: the others are compared with it)")
    ap.add_argument("--sets", nargs="*", default=[], help="held-out sets too: humaneval champ sharegpt-dev")
    ap.add_argument("--held-out-limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seed-data", nargs="*", default=SEED_DATA)
    ap.add_argument("--seed-max-tokens", type=int, default=1 << 21)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="docs/suffix")
    ap.add_argument("--index-scaling", nargs="*", type=int, default=None,
                    help="only time lookups at these index sizes (e.g. 10000 100000 1000000 10000000)")
    args = ap.parse_args(argv)
    if args.methods[0] != "target":
        ap.error("--methods must start with target (every output is checked against it)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.index_scaling is not None:
        rows = index_scaling(args.index_scaling or [10_000, 100_000, 1_000_000, 10_000_000])
        (out / "index_scaling.json").write_text(json.dumps({"rows": rows, "machine": machine(args)}, indent=1))
        print("\n".join(f"{r['indexed_tokens']:>10} tokens: {r['median_lookup_us']:.1f} us median, {r['p90_lookup_us']:.1f} us p90, "
                        f"{r['found']:.0%} found, {r['nbytes'] / 2**20:.0f} MiB" for r in rows))
        return
    results = run(args)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(markdown(results["summary"]))
    plot(results["summary"], out / "suffix.png")
    print(markdown(results["summary"]))


if __name__ == "__main__":
    main()
