"""Side-by-side benchmark: target alone, prompt lookup, DFlash-1-style drafting, DFlash 2.

    python -m dflash2_tools.benchmark --prompt-sets humaneval champ sharegpt-dev --limit 10 --out docs/bench

All methods run in ONE process on the same prompts, after a warm-up, through transformers'
own ``generate``:

* ``target``: ``target.generate(...)``
* ``pld``: prompt lookup decoding (``prompt_lookup_num_tokens=10``)
* ``dflash1``: the same drafter through transformers' built-in ``speculation_type="dflash"``
  (argmax drafting, no selector: the DFlash-1 way)
* ``dflash2``: ``target.generate(..., assistant_model=drafter, prompt_lookup_num_tokens=0)`` (block
  draft, top-K, selector walk; the hybrid n-gram proposer off)
* ``dflash2+ngram``: the plain call as a user makes it, ``target.generate(..., assistant_model=drafter)``:
  the hybrid rule verifies the block draft or a prompt-lookup continuation each step (ngram_dflash2.py);
  ``dflash2+ngram-kN`` (``--ngram-tokens N``) with n-gram continuations of up to N tokens
* ``dflash2+ngram-table`` / ``dflash2+ngram-measured``: the plain call with one path per step and the step
  costs forced to the per-device table (as before costs were measured) / to this device's measurement
  (``costs_dflash2.step_costs``); ``dflash2+ngram`` is the default: costs by device, ``tree_budget="auto"``;
  ``dflash2-rule-measured``: the default with this device's measured costs (the whole rule: the tree or path choice,
  the proposals, the lengths), to hold against the fixed policies (``dflash2``, ``dflash2-tree``, ``pld``, ...)
* ``dflash2-fullvocab``: the same with the full LM head instead of the drafter's draft vocabulary
  (``draft_vocab_ids``; run only when the drafter has one): what the sub-vocabulary saves and costs
* ``dflash2-dN`` (``--draft-tokens N``): the same, verifying only the first N drafted tokens
  (``num_assistant_tokens=N``): on a compute-bound CPU each verified token costs real time
* ``dflash2-tree``: tree verification (``tree_dflash2.py``): a best-first tree of ``--tree-budget``
  nodes through the top-K lattice in one target forward; ``dflash2-tree+ngram`` adds the n-gram
  continuation as one more branch
* ``target-static-compiled`` / ``dflash2+ngram-static-compiled``: like with like, the target alone and the plain
  call both on a static cache of one length for the whole run, both through ``torch.compile`` (inductor; on a CPU
  via ``compile_config._compile_all_devices``); the compile time is the warm-up's, reported apart (the compiled
  methods warm up on every set's first prompt at full length too, so that no timed prompt compiles)
* ``llama.cpp``, ``llama.cpp+dflash2``, ``llama.cpp+ngram`` (greedy only; llama.cpp built by
  ``python -m dflash2_tools.llamacpp build``): the target's Q4_1 GGUF in llama.cpp, alone
  (``llama-bench`` decoding 128 tokens at the prompt's depth), with this drafter converted by
  llama.cpp's own converter (``--spec-type draft-dflash``, the whole block), and with its n-gram
  drafting (``ngram-simple``); decode tok/s and tokens per target forward as llama.cpp prints them.
  Their text is llama.cpp's target's (not compared with ours: a different quantisation of numerics)
* ``--batch-sizes 1 4 8``: batches instead (``bench_batch.py``): the target's own batched ``generate`` against
  the plain call on the same left-padded batches

Acceptance length for every method = new tokens / target forwards after the prefill (a counter
on the target's forward), so the numbers are comparable. Every greedy output is checked against
the target's own greedy output. Results: ``results.json``, ``results.md`` (the table) and PNG plots.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from . import drafter as root
from .prompts import load_prompt_set
from .target import EMBEDDED_TARGET, load_target

METHODS = ("target", "pld", "dflash1", "dflash2", "dflash2+ngram-table", "dflash2+ngram-measured", "dflash2+ngram", "dflash2-rule-measured",
           "dflash2-tree", "dflash2-tree+ngram", "dflash2-fullvocab",
           "target-static-compiled", "dflash2+ngram-static-compiled", "llama.cpp", "llama.cpp+dflash2", "llama.cpp+ngram")
STATIC_COMPILED = "-static-compiled"


def compile_on_any_device(cuda: bool = False):
    """transformers' ``CompileConfig`` that compiles generate's decoding forward on a CPU too (by itself transformers
    compiles on accelerators only); inductor, "reduce-overhead" (CUDA graphs) on CUDA."""
    from transformers import CompileConfig

    config = CompileConfig(mode="reduce-overhead" if cuda else "default")
    config._compile_all_devices = True
    return config


def run_cache_length(tokenizer, records, max_new_tokens: int) -> int:
    """One static cache length for every prompt of a run (chat-templated), rounded up to 128: one set of shapes."""
    longest = max(len(tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True)) for r in records)
    return -(-(longest + max_new_tokens + 64) // 128) * 128


def engine_ms_per_step(seconds: float, prefill_seconds: float, forward_seconds: float, draft_seconds: float, forwards: int) -> float:
    """The engine's own work per decoding step: a call's wall time outside the prefill, the target's verification
    forwards and drafting, per verification forward."""
    return 1e3 * (seconds - prefill_seconds - forward_seconds - draft_seconds) / max(forwards, 1)


def static_compiled_kwargs(cache_length: int) -> dict:
    """generate() kwargs for a static cache of one fixed length (one set of shapes for the whole run), compiled on
    any device."""
    return dict(cache_implementation="static", compile_config=compile_on_any_device(torch.cuda.is_available()),
                max_cache_len=cache_length)


LLAMACPP_METHODS = ("llama.cpp", "llama.cpp+dflash2", "llama.cpp+ngram")


def method_rank(method: str) -> tuple[int, int]:
    """Table order: METHODS, then ``dflash2-dN`` and ``dflash2+ngram-kN`` by N."""
    for i, prefix in enumerate(("dflash2-d", "dflash2+ngram-k")):
        if method.startswith(prefix):
            return len(METHODS) + i, int(method[len(prefix):])
    return METHODS.index(method), 0


class ForwardCounter:
    """Counts and times the target's forward calls (one per prefill / decode / verification step)."""

    def __init__(self, model):
        self.reset()
        self.handles = [model.register_forward_pre_hook(self._start), model.register_forward_hook(self._stop)]

    def reset(self):
        self.calls, self.seconds, self.first_seconds, self._t0 = 0, 0.0, 0.0, None

    def _start(self, module, args):
        self.calls += 1
        self._t0 = time.perf_counter()

    def _stop(self, module, args, output):
        dt = time.perf_counter() - self._t0
        if self.calls == 1:
            self.first_seconds = dt  # the prefill
        else:
            self.seconds += dt

    def remove(self):
        for h in self.handles:
            h.remove()


@contextlib.contextmanager
def config_override(drafter, **values):
    """Set drafter config fields for the duration of one call (e.g. ``draft_vocab_ids=None``: the full
    LM head; ``tree_budget=16``: tree verification)."""
    saved = {key: getattr(drafter.config, key) for key in values}
    for key, value in values.items():
        setattr(drafter.config, key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(drafter.config, key, value)


def run_llamacpp_method(method, llama, prompt_text: str, prompt_tokens: int, gen_kw) -> dict:
    """One prompt through llama.cpp (``llama``: bin folder, converted drafter, threads)."""
    from . import llamacpp

    if gen_kw.get("do_sample"):
        raise ValueError(f"{method} runs greedy only: drop it from --methods or use --temperatures 0")
    n_new = gen_kw["max_new_tokens"]
    if method == "llama.cpp":
        tok_per_s, accepted = llamacpp.target_alone_tok_per_s(llama.bin_dir, n_new, llama.threads, depth=prompt_tokens), 1.0
    else:
        if method == "llama.cpp+dflash2":
            spec_type, draft_gguf, n_draft = "draft-dflash", llama.gguf, llama.block - 1  # the whole block
        else:
            spec_type, draft_gguf, n_draft = "ngram-simple", None, None
        result = llamacpp.run_llamacpp(llama.bin_dir, prompt_text, draft_gguf, spec_type, n_new, llama.threads, n_draft)
        tok_per_s, accepted = result["tok_per_s"], result["acceptance_length"]
    return {"step_ms": 1e3 * accepted / tok_per_s, "step_target_forward_ms": float("nan"), "step_draft_ms": float("nan"),
            "step_overhead_ms": float("nan"), "seconds": n_new / tok_per_s, "new_tokens": n_new, "tok_per_s": tok_per_s,
            "acceptance_length": accepted, "per_position_acceptance": None, "accept_lengths": None, "per_proposer": None}


def llamacpp_setup(drafter_dir: str, block_size: int):
    """Build llama.cpp (once) and convert the drafter with llama.cpp's own converter."""
    from types import SimpleNamespace

    from . import llamacpp

    return SimpleNamespace(bin_dir=llamacpp.build(), gguf=llamacpp.convert(drafter_dir), block=block_size, threads=torch.get_num_threads())


def run_method(method, target, drafter, inputs, gen_kw, counter, tree_nodes: int = 16, cache_length: int = 0):
    gen = root.generation_of(drafter)
    kw = dict(gen_kw)
    if method.endswith(STATIC_COMPILED):  # like with like: the target alone and the plain call, both static + compiled
        kw.update(static_compiled_kwargs(cache_length))
        method = method.removesuffix(STATIC_COMPILED)
    stats = None
    counter.reset()
    t0 = time.perf_counter()
    if method == "target":
        out = target.generate(**inputs, **kw)
    elif method == "pld":
        out = target.generate(**inputs, prompt_lookup_num_tokens=10, **kw)
    elif method == "dflash1":
        out = target.generate(**inputs, assistant_model=drafter, speculation_type="dflash", **kw)
    elif method.startswith("dflash2"):
        if method.startswith("dflash2-d"):
            kw["num_assistant_tokens"] = int(method[len("dflash2-d"):])
        if method.startswith("dflash2+ngram-k"):
            kw["prompt_lookup_num_tokens"] = int(method[len("dflash2+ngram-k"):])
        elif not method.startswith(("dflash2+ngram", "dflash2-tree+ngram", "dflash2-rule")):
            kw["prompt_lookup_num_tokens"] = 0  # the block draft alone
        overrides = {}
        if method.startswith("dflash2-tree"):
            overrides["tree_budget"] = tree_nodes
        elif not method.startswith(("dflash2+ngram", "dflash2-rule")) or method in ("dflash2+ngram-table", "dflash2+ngram-measured"):
            overrides["tree_budget"] = None  # one path (the plain call keeps the drafter's own tree_budget, "auto")
        if method == "dflash2-fullvocab":
            overrides["draft_vocab_ids"] = None
        if method in ("dflash2+ngram-table", "dflash2+ngram-measured", "dflash2-rule-measured"):  # costs forced to one source
            overrides["hybrid_ngram"] = {**(drafter.config.hybrid_ngram or {}), "costs": method.rsplit("-", 1)[1]}
        with config_override(drafter, **overrides), gen.collect_stats() as runs:
            out = target.generate(**inputs, assistant_model=drafter, **kw)
        stats = runs[-1] if runs else None
    else:
        raise ValueError(method)
    seconds = time.perf_counter() - t0
    new = out.shape[1] - inputs["input_ids"].shape[1]
    forwards = max(counter.calls - 1, 1)  # after the prefill
    draft = stats.draft_seconds if stats else 0.0
    return out, {
        # one decoding step = one target forward after the prefill; where its time goes:
        "step_ms": 1e3 * (seconds - counter.first_seconds) / forwards,
        "step_target_forward_ms": 1e3 * counter.seconds / forwards,
        "step_draft_ms": 1e3 * draft / forwards,
        "step_overhead_ms": engine_ms_per_step(seconds, counter.first_seconds, counter.seconds, draft, forwards),
        "seconds": seconds,
        "new_tokens": new,
        "tok_per_s": new / seconds,
        "acceptance_length": (new - 1) / forwards if new > 1 else 1.0,
        "per_position_acceptance": stats.per_position_acceptance if stats else None,
        "accept_lengths": stats.accept_lengths if stats else None,
        "per_proposer": stats.as_dict()["per_proposer"] if stats else None,
        "mode": stats.mode if stats else None,
        "costs": stats.costs if stats else None,
    }


def benchmark(args):
    results, warmups = [], {}
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        target, tokenizer = load_target(args.target, dtype=dtype)
        drafter = root.load_drafter(args.drafter, dtype=dtype).eval()
        methods = [m for m in args.methods if m != "dflash2-fullvocab" or drafter.config.draft_vocab_ids is not None]
        counter = ForwardCounter(target)
        llama = llamacpp_setup(args.drafter, drafter.config.block_size) if set(methods) & set(LLAMACPP_METHODS) else None
        sets = {name: load_prompt_set(name)[: args.limit] for name in args.prompt_sets}
        warm = tokenizer.apply_chat_template([{"role": "user", "content": "Hello!"}], add_generation_prompt=True, return_tensors="pt", return_dict=True)
        cache_length = run_cache_length(tokenizer, [r for v in sets.values() for r in v], args.max_new_tokens)
        # compiled methods warm up on every set's first prompt at full length too: a 16-token call does not reach every
        # verification size the loop compiles (row buckets 1, 2, 4, ...) nor every guard, and compiling inside a timed
        # prompt is what a deployment's warm-up avoids
        long_warm = [tokenizer.apply_chat_template(v[0]["messages"], add_generation_prompt=True, return_tensors="pt", return_dict=True)
                     for v in sets.values() if v]
        new_index = root.suffix_index_class(drafter) or (lambda: None)  # None: drafter code from before the index
        indexes = {}  # per method, the drafter's index over that method's own earlier outputs (in prompt order)
        for method in methods:  # warm-up every path once (llama.cpp runs in its own process); compiles the compiled ones
            if method not in LLAMACPP_METHODS:
                drafter.suffix_index = new_index()  # the warm-up's outputs are not remembered
                t0 = time.perf_counter()
                run_method(method, target, drafter, warm, dict(do_sample=False, max_new_tokens=16), counter, args.tree_budget, cache_length)
                for inputs in long_warm if method.endswith(STATIC_COMPILED) else []:
                    run_method(method, target, drafter, inputs, dict(do_sample=False, max_new_tokens=args.max_new_tokens), counter,
                               args.tree_budget, cache_length)
                warmups[(dtype_name, method)] = time.perf_counter() - t0
        total = sum(len(v) for v in sets.values()) * len(args.temperatures)
        bar = tqdm(total=total, desc=f"benchmark {dtype_name}", unit="prompt")
        for set_name, records in sets.items():
            for rec in records:
                inputs = tokenizer.apply_chat_template(rec["messages"], add_generation_prompt=True, return_tensors="pt", return_dict=True)
                text = tokenizer.apply_chat_template(rec["messages"], add_generation_prompt=True, tokenize=False) if llama else None
                for temperature in args.temperatures:
                    gen_kw = dict(max_new_tokens=args.max_new_tokens)
                    gen_kw.update(do_sample=False) if temperature == 0 else gen_kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
                    reference = None
                    for method in methods:
                        torch.manual_seed(0)
                        if method in LLAMACPP_METHODS:
                            out, row = None, run_llamacpp_method(method, llama, text, inputs["input_ids"].shape[1], gen_kw)
                        else:
                            drafter.suffix_index = indexes.setdefault(method, new_index())
                            out, row = run_method(method, target, drafter, inputs, gen_kw, counter, args.tree_budget, cache_length)
                            row["warmup_seconds"] = warmups[(dtype_name, method)]  # the compile time of the compiled methods
                        if method == "target":
                            reference = out
                        row.update(dtype=dtype_name, prompt_set=set_name, prompt_id=rec["id"], method=method, temperature=temperature,
                                   peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
                        if temperature == 0 and reference is not None and out is not None:
                            row["same_as_target"] = bool(torch.equal(out, reference))
                        results.append(row)
                    bar.update(1)
        bar.close()
        counter.remove()
    return results


def summarize(results):
    """Median tok/s, speedup (median of per-prompt ratios to the target alone) and acceptance per group."""
    groups = {}
    for r in results:
        groups.setdefault((r["dtype"], r["temperature"], r["prompt_set"], r["method"]), []).append(r)
    base = {(r["dtype"], r["temperature"], r["prompt_set"], r["prompt_id"]): r["tok_per_s"] for r in results if r["method"] == "target"}
    llama_base = {(r["dtype"], r["temperature"], r["prompt_set"], r["prompt_id"]): r["tok_per_s"] for r in results if r["method"] == "llama.cpp"}
    rows = []
    for (dtype, temp, pset, method), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2], method_rank(kv[0][3]))):
        ratios = [r["tok_per_s"] / base[(dtype, temp, pset, r["prompt_id"])] for r in rs]
        # llama.cpp's drafting rows are also measured against llama.cpp's target alone, prompt by prompt
        alone = [r["tok_per_s"] / llama_base[(dtype, temp, pset, r["prompt_id"])] for r in rs
                 if method in LLAMACPP_METHODS and (dtype, temp, pset, r["prompt_id"]) in llama_base]
        checked = [r["same_as_target"] for r in rs if "same_as_target" in r]
        proposers = {}  # pooled over the group's prompts: which proposer each step verified, and its acceptance
        for r in rs:
            for name, c in (r.get("per_proposer") or {}).items():
                mine = proposers.setdefault(name, {"steps": 0, "drafted": 0, "accepted": 0})
                for key in mine:
                    mine[key] += c[key]
        rows.append({
            "dtype": dtype, "temperature": temp, "prompt_set": pset, "method": method, "prompts": len(rs),
            "median_tok_per_s": statistics.median(r["tok_per_s"] for r in rs),
            "median_speedup": statistics.median(ratios),
            "median_speedup_vs_llamacpp": statistics.median(alone) if alone else None,
            "mean_acceptance_length": statistics.mean(r["acceptance_length"] for r in rs),
            "lossless": f"{sum(checked)}/{len(checked)}" if checked else ("n/a (llama.cpp's own text)" if method in LLAMACPP_METHODS else "n/a (sampling)"),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
            "per_proposer": {k: {**c, "mean_acceptance_length": (c["accepted"] + c["steps"]) / max(c["steps"], 1)} for k, c in proposers.items()},
            "modes": sorted({r["mode"] for r in rs if r.get("mode")}),  # linear / tree-N: what tree_budget="auto" chose
            "warmup_seconds": rs[0].get("warmup_seconds"),  # the warm-up calls: include compilation where compiled
            **{k: statistics.median(r[k] for r in rs) for k in ("step_ms", "step_target_forward_ms", "step_draft_ms", "step_overhead_ms")},
        })
    return rows


def markdown_table(rows) -> str:
    head = "| dtype | T | prompt set | method | prompts | median tok/s | median speedup | acceptance length | greedy == target | peak RSS MB |\n"
    head += "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
    return head + "".join(
        f"| {r['dtype']} | {r['temperature']:g} | {r['prompt_set']} | {r['method']} | {r['prompts']} | {r['median_tok_per_s']:.1f} | "
        f"{r['median_speedup']:.2f}x | {r['mean_acceptance_length']:.2f} | {r['lossless']} | {r['peak_rss_mb']:.0f} |\n"
        for r in rows
    )


def llamacpp_table(rows) -> str:
    """The llama.cpp rows against llama.cpp's target alone (empty without llama.cpp rows)."""
    rows = [r for r in rows if r.get("median_speedup_vs_llamacpp") is not None]
    if not rows:
        return ""
    head = "| dtype | prompt set | method | median tok/s | speedup vs llama.cpp alone | tokens per target forward |\n| --- | --- | --- | --- | --- | --- |\n"
    return head + "".join(f"| {r['dtype']} | {r['prompt_set']} | {r['method']} | {r['median_tok_per_s']:.1f} | "
                          f"{r['median_speedup_vs_llamacpp']:.2f}x | {r['mean_acceptance_length']:.2f} |\n" for r in rows)


def profile_table(rows) -> str:
    """Where one decoding step's time goes (medians over prompts): the target's forward, drafting, the rest."""
    head = ("| dtype | T | prompt set | method | step ms | target forward ms | draft ms | other ms | warm-up s (compile) |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
    return head + "".join(
        f"| {r['dtype']} | {r['temperature']:g} | {r['prompt_set']} | {r['method']} | {r['step_ms']:.1f} | "
        f"{r['step_target_forward_ms']:.1f} | {r['step_draft_ms']:.1f} | {r['step_overhead_ms']:.1f} | {r.get('warmup_seconds') or 0:.1f} |\n"
        for r in rows
    )


def plot(results, rows, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drafting = next((m for m in ("dflash2", "dflash2+ngram") if any(r["method"] == m and r["per_position_acceptance"]
                                                                     for r in results)), None)
    spec = [r for r in results if r["method"] == drafting and r["per_position_acceptance"]]
    fig, axes = plt.subplots(1, 3, figsize=(16.5, 4)) if spec else plt.subplots(1, 1, figsize=(7, 4), squeeze=False)
    axes = list(axes.flat) if not spec else axes
    if not spec:  # no drafter steps to draw: the speedup panel alone
        axes = [None, None, axes[0]]
    if spec:
        n = len(spec[0]["per_position_acceptance"])
        for pset in sorted({r["prompt_set"] for r in spec}):
            rs = [r for r in spec if r["prompt_set"] == pset and r["temperature"] == 0]
            if rs:
                curve = [statistics.mean(r["per_position_acceptance"][i] for r in rs) for i in range(n)]
                axes[0].plot(range(1, n + 1), curve, "o-", label=pset)
        axes[0].set(title=f"{drafting}: per-position acceptance (T=0)", xlabel="block position", ylabel="P(accepted | drafted)", ylim=(0, 1))
        axes[0].legend()
        lengths = [a for r in spec for a in r["accept_lengths"]]
        axes[1].hist(lengths, bins=range(1, max(lengths) + 2), align="left", rwidth=0.8)
        axes[1].set(title=f"{drafting}: tokens per target forward", xlabel="tokens per target forward", ylabel="steps")
    greedy = [r for r in rows if r["temperature"] == rows[0]["temperature"]]
    sets = sorted({r["prompt_set"] for r in greedy})
    methods = sorted({(r["dtype"], r["method"]) for r in greedy}, key=lambda dm: (dm[0], method_rank(dm[1])))
    width = 0.8 / max(len(methods), 1)
    for i, (dtype, method) in enumerate(methods):  # grouped bars: one group per prompt set, one bar per method
        values = [next((r["median_speedup"] for r in greedy if (r["prompt_set"], r["dtype"], r["method"]) == (s, dtype, method)), 0.0)
                  for s in sets]
        axes[2].bar([j + (i - (len(methods) - 1) / 2) * width for j in range(len(sets))], values, width,
                    label=method if len(args_dtypes(rows)) == 1 else f"{method} ({dtype})")
    axes[2].set_xticks(range(len(sets)), sets)
    axes[2].axhline(1.0, color="k", lw=0.5)
    axes[2].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: tall bars would hide under it
    axes[2].set(title=f"median speedup vs the transformers target alone (T={rows[0]['temperature']:g})" if rows else "median speedup", ylabel="x")
    fig.tight_layout()
    fig.savefig(out / "benchmark.png", dpi=110)


def args_dtypes(rows) -> set:
    return {r["dtype"] for r in rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=EMBEDDED_TARGET)
    ap.add_argument("--drafter", default=str(root.REPO_ROOT))
    ap.add_argument("--prompt-sets", nargs="+", default=["humaneval", "champ", "sharegpt-dev"])
    ap.add_argument("--limit", type=int, default=10, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32"])
    ap.add_argument("--temperatures", nargs="+", type=float, default=[0.0])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--draft-tokens", nargs="*", type=int, default=[],
                    help="also run DFlash 2 verifying only N drafted tokens per step (method dflash2-dN)")
    ap.add_argument("--ngram-tokens", nargs="*", type=int, default=[],
                    help="also run the hybrid with n-gram continuations of up to N tokens (method dflash2+ngram-kN)")
    ap.add_argument("--tree-budget", type=int, default=16, help="tree nodes per step of the dflash2-tree methods")
    ap.add_argument("--out", default="docs/bench")
    ap.add_argument("--replot", action="store_true", help="only redraw benchmark.png from --out's results.json")
    ap.add_argument("--batch-sizes", nargs="*", type=int, default=[],
                    help="batches instead of methods: the target's batched generate against the plain call, per batch size "
                         "(bench_batch.py; greedy, the first of --dtypes)")
    ap.add_argument("--batch-static-compiled", action="store_true",
                    help="with --batch-sizes: both the target's batched generate and the plain call on a static cache, compiled")
    ap.add_argument("--batch-rules", nargs="+", default=["rule"], choices=["rule", "longest", "plain"],
                    help="with --batch-sizes: the drafter's own rule, and forced extremes to check it against (every step "
                         "verifies the longest proposal / plain batched steps only)")
    args = ap.parse_args(argv)
    if args.batch_sizes:
        from .bench_batch import benchmark_batches, write

        target, tokenizer = load_target(args.target, dtype=getattr(torch, args.dtypes[0]))
        drafter = root.load_drafter(args.drafter, dtype=getattr(torch, args.dtypes[0])).eval()
        write(benchmark_batches(args, target, tokenizer, drafter), args, Path(args.out))
        return
    if args.replot:
        saved = json.loads((Path(args.out) / "results.json").read_text())
        plot(saved["runs"], saved["summary"], Path(args.out))
        return
    args.methods += [f"dflash2-d{n}" for n in args.draft_tokens] + [f"dflash2+ngram-k{n}" for n in args.ngram_tokens]
    if "target" not in args.methods:
        args.methods = ["target", *args.methods]  # speedups and lossless checks need it
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = benchmark(args)
    rows = summarize(results)
    table = markdown_table(rows)
    from .card import machine_info

    (out / "results.json").write_text(json.dumps({"args": vars(args), "machine": machine_info(), "summary": rows, "runs": results},
                                                 indent=1))
    profile = profile_table([r for r in rows if r["method"] not in LLAMACPP_METHODS])
    llama_rows = llamacpp_table(rows)
    if llama_rows:
        table += "\nllama.cpp (Q4_1 target, same prompts) against llama.cpp's target alone:\n\n" + llama_rows
    (out / "results.md").write_text(table + "\nPer decoding step (one target forward after the prefill):\n\n" + profile)
    plot(results, rows, out)
    print(table)
    print("Per decoding step (one target forward after the prefill):\n")
    print(profile)


if __name__ == "__main__":
    main()
