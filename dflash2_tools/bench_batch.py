"""Batches side by side: the target's own batched ``generate`` against the plain call on the same batch.

    python -m dflash2_tools.benchmark --batch-sizes 1 4 8 --prompt-sets humaneval champ sharegpt-dev --limit 8 \\
        --dtypes float32 --out docs/bench-batch

Per prompt set and batch size b: the set's first ``limit`` prompts (chat template, left-padded) in consecutive
batches of b; each batch runs ``target.generate(**batch)`` and ``target.generate(**batch, assistant_model=drafter)``
back to back, in alternating order (greedy, every row checked equal to the target's), after one warm-up batch per
size (a whole one when compiled: every shape compiles there). ``--batch-static-compiled`` runs both calls on one static
cache, compiled (inductor; on a CPU too): like with like. ``--batch-rules longest plain`` adds the forced extremes the rule is checked against. Reported:
throughput (new tokens, EOS included, per second over the batch; the median over batches and the pooled total),
the ratio to the target's, tokens per target forward (new tokens of the batch / verification forwards, and per row),
and what the rule chose, and the engine's own work per step (wall time outside the target's forwards and drafting). ``results.json``, ``results.md`` and ``batch.png`` in ``--out``.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from . import drafter as root
from .benchmark import ForwardCounter, engine_ms_per_step, run_cache_length, static_compiled_kwargs
from .prompts import load_prompt_set


# ``--batch-rules``: the drafter's own rule, and two forced extremes to check its choice against (costs that make
# every verification free: each step verifies the longest proposal; or prohibitive: plain batched steps only)
FORCED_COSTS = {"longest": {"multi_token_step": 0.0, "per_token": 0.0, "draft": 0.0},
                "plain": {"multi_token_step": 1e3, "per_token": 1e3, "draft": 1e3}}


def left_padded(tokenizer, records) -> dict:
    """A batch of chat prompts, left-padded (the side a decoder-only batch needs)."""
    texts = [tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False) for r in records]
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = side


def new_tokens(sequences: torch.Tensor, prompt_width: int, eos: set[int], pad: int) -> list[int]:
    """Generated tokens per row: up to and including its EOS (the padding after it is not generated)."""
    counts = []
    for row in sequences[:, prompt_width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        counts.append(end)
    return counts


def run_batch(target, drafter, inputs, gen_kw, eos, pad, target_first: bool = True, counter=None) -> dict:
    """The target alone and the plain call on one batch, back to back (``target_first``: which one goes first;
    the benchmark alternates, so a machine that slows down or speeds up over minutes favours neither).
    ``counter`` (a ``benchmark.ForwardCounter`` on the target) times the plain call's target forwards: the engine's
    own work per step is the wall time outside them and outside drafting."""
    gen = root.generation_of(drafter)
    forwards = {}

    def alone():
        t0 = time.perf_counter()
        return target.generate(**inputs, **gen_kw), time.perf_counter() - t0

    def speculative():
        with gen.collect_stats() as runs:
            if counter is not None:
                counter.reset()
            t0 = time.perf_counter()
            out = target.generate(**inputs, assistant_model=drafter, **gen_kw)
            seconds = time.perf_counter() - t0
            if counter is not None:  # the plain call's forwards, before the other call adds its own
                forwards.update(calls=counter.calls, prefill=counter.first_seconds, steps=counter.seconds)
            return out, seconds, runs[-1]

    if target_first:
        (ref, target_seconds), (out, spec_seconds, stats) = alone(), speculative()
    else:
        (out, spec_seconds, stats), (ref, target_seconds) = speculative(), alone()
    width = inputs["input_ids"].shape[1]
    tokens = new_tokens(ref, width, eos, pad)
    engine_ms = None
    if forwards.get("calls", 0) > 1:  # after the prefill: wall - target forwards - drafting, per step
        engine_ms = engine_ms_per_step(spec_seconds, forwards["prefill"], forwards["steps"], stats.draft_seconds, forwards["calls"] - 1)
    return {"engine_ms_per_step": engine_ms, "rows": len(tokens), "new_tokens": sum(tokens), "target_seconds": target_seconds, "spec_seconds": spec_seconds,
            "same_as_target": bool(torch.equal(ref, out)), "costs": stats.costs, "forwards": stats.forwards if stats.batch_size > 1 else len(stats.accept_lengths),
            "spec_new_tokens": stats.new_tokens, "row_acceptance": [sum(r) / max(len(r), 1) for r in stats.row_accept_lengths]
            if stats.batch_size > 1 else [stats.mean_acceptance_length], "proposers": dict(stats.per_proposer)}


def summarize(runs: list[dict]) -> dict:
    tokens = sum(r["new_tokens"] for r in runs)
    target_tps = [r["new_tokens"] / r["target_seconds"] for r in runs]
    spec_tps = [r["new_tokens"] / r["spec_seconds"] for r in runs]
    proposers = {}
    for r in runs:
        for name, c in r["proposers"].items():
            proposers[name] = proposers.get(name, 0) + c["steps"]
    return {
        "batches": len(runs),
        "target_tok_s": tokens / sum(r["target_seconds"] for r in runs),
        "spec_tok_s": tokens / sum(r["spec_seconds"] for r in runs),
        "median_target_tok_s": statistics.median(target_tps),
        "median_spec_tok_s": statistics.median(spec_tps),
        "speedup": sum(r["target_seconds"] for r in runs) / sum(r["spec_seconds"] for r in runs),
        "tokens_per_forward": sum(r["spec_new_tokens"] for r in runs) / max(sum(r["forwards"] for r in runs), 1),
        "row_acceptance_mean": statistics.mean(a for r in runs for a in r["row_acceptance"]),
        "all_same_as_target": all(r["same_as_target"] for r in runs),
        "row_steps_by_proposer": proposers,
        "median_engine_ms_per_step": statistics.median(r["engine_ms_per_step"] for r in runs) if runs[0].get("engine_ms_per_step") is not None else None,
    }


def markdown(rows: list[dict]) -> str:
    lines = ["| set | batch | rule | target tok/s | plain call tok/s | speedup | tokens / forward | mean row acceptance | same as target | engine ms / step | row steps (proposer) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['set']} | {r['batch_size']} | {r.get('rule', 'rule')} | {r['target_tok_s']:.1f} | {r['spec_tok_s']:.1f} | {r['speedup']:.2f}x | "
                     f"{r['tokens_per_forward']:.2f} | {r['row_acceptance_mean']:.2f} | {r['all_same_as_target']} | "
                     f"{r['median_engine_ms_per_step'] if r.get('median_engine_ms_per_step') is None else format(r['median_engine_ms_per_step'], '.1f')} | "
                     f"{', '.join(f'{k} {v}' for k, v in sorted(r['row_steps_by_proposer'].items()))} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(dict.fromkeys(r["set"] for r in rows))
    sizes = sorted({(r["batch_size"], r.get("rule", "rule")) for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    width = 0.8 / len(sizes)
    for k, (size, rule) in enumerate(sizes):
        xs = [i + k * width for i in range(len(sets))]
        by_set = {r["set"]: r for r in rows if (r["batch_size"], r.get("rule", "rule")) == (size, rule)}
        label = f"batch {size}" + ("" if rule == "rule" else f", {rule}")
        axes[0].bar(xs, [by_set[s]["speedup"] if s in by_set else 0 for s in sets], width, label=label)
        axes[1].bar(xs, [by_set[s]["spec_tok_s"] if s in by_set else 0 for s in sets], width, label=label)
    for ax, title in zip(axes, ("plain call / target's batched generate (wall clock)", "plain call throughput, tok/s")):
        ax.set_xticks([i + width * (len(sizes) - 1) / 2 for i in range(len(sets))], sets)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    axes[0].axhline(1.0, color="k", lw=0.8)
    fig.tight_layout()
    fig.savefig(out / "batch.png", dpi=120)
    plt.close(fig)


def benchmark_batches(args, target, tokenizer, drafter) -> list[dict]:
    eos = target.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    gen_kw = dict(do_sample=False, max_new_tokens=args.max_new_tokens, pad_token_id=pad)
    if getattr(args, "batch_static_compiled", False):  # like with like: both calls on a static cache, compiled
        records = [r for name in args.prompt_sets for r in load_prompt_set(name)[: args.limit]]
        gen_kw.update(static_compiled_kwargs(run_cache_length(tokenizer, records, args.max_new_tokens)))
    own = drafter.config.hybrid_ngram
    counter = ForwardCounter(target)
    rows = []
    for name in args.prompt_sets:
        records = load_prompt_set(name)[: args.limit]
        for size in args.batch_sizes:
            batches = [records[i : i + size] for i in range(0, len(records) - size + 1, size)]
            if not batches:
                raise SystemExit(f"--limit {args.limit} gives no full batch of {size}: raise --limit to at least {size}")
            for rule in args.batch_rules:
                drafter.config.hybrid_ngram = own if rule == "rule" else {**(own or {}), "costs": FORCED_COSTS[rule]}
                try:
                    warm = gen_kw if "compile_config" in gen_kw else {**gen_kw, "max_new_tokens": 8}  # compiled: every shape
                    run_batch(target, drafter, left_padded(tokenizer, batches[0]), warm, eos, pad)  # warm-up
                    runs = [run_batch(target, drafter, left_padded(tokenizer, b), gen_kw, eos, pad, target_first=k % 2 == 0,
                                      counter=counter)
                            for k, b in enumerate(tqdm(batches, desc=f"{name} batch {size} ({rule})", unit="batch"))]
                finally:
                    drafter.config.hybrid_ngram = own
                rows.append({"set": name, "batch_size": size, "rule": rule, **summarize(runs), "costs": runs[0]["costs"],
                             "runs": runs})
    return rows


def write(rows: list[dict], args, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, "rows": rows}, indent=1))
    table = markdown(rows)
    (out / "results.md").write_text(table)
    plot(rows, out)
    print(table)
