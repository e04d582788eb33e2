"""Ablations of the training recipe at a fixed CPU budget: each lever alone and all combined.

    python -m dflash2_tools.training.ablate --out runs/ablate --budget-cpu-minutes 10 --train-limit 600
    python -m dflash2_tools.training.ablate --out runs/ablate-336 --steps 336 --only ...   # equal steps

Every run starts from scratch on the same training subset (the first ``--train-limit`` training
sequences), trains for the same CPU time of its own process (``--budget-cpu-minutes``, the
cosine schedule following it), and is evaluated on the same dev sequences: on-policy acceptance
(what the plain call measures on the target's own greedy data), argmax and selector. The feature
store is filled before the runs (its one-off cost is printed, not charged to a run: it is paid
once per data set and shared by every later run and epoch). Resumable: a finished run is
skipped, an interrupted one resumes. Writes ``OUT/ablations.json``, a markdown table and a PNG.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .loop import main as train_main

DATA = ["data/smollm2-sharegpt-fp32-128", "data/smollm2-sharegpt-fp32", "data/smollm2-sharegpt"]
FAST = ["--loss-vocab", "draft", "--feature-cache", "disk"]
RUNS = {  # name -> flags on top of the common ones
    "old recipe": ["--loss-vocab", "full", "--feature-cache", "online"],
    "throughput (draft-vocab CE + stored features)": FAST,
    "throughput + distillation": FAST + ["--distill-weight", "1"],
    "throughput + chain weighting": FAST + ["--position-weighting", "chain"],
    "throughput + init from target": FAST + ["--init-from-target"],
    "all levers": FAST + ["--distill-weight", "1", "--position-weighting", "chain", "--init-from-target"],
}
RECIPE = RUNS["all levers"]  # the current recipe for a fresh drafter (3 layers, block 8, 128-token greedy responses)
LEVERS = {  # issue 41's next levers, each against the current recipe at the same CPU budget (--levers)
    "current recipe (3 layers, block 8)": RECIPE,
    "block 16": RECIPE + ["--block-size", "16"],
    "4 layers": RECIPE + ["--layers", "4"],
    "5 layers": RECIPE + ["--layers", "5"],
    "256-token responses": RECIPE + ["--max-response-tokens", "256"],  # run on 256-token data: --data with those folders
    # the same prompts' responses sampled at T=0.8 (what users who sample see), then the greedy folder for the rest
    "sampled responses (T=0.8)": RECIPE + ["--data", "data/smollm2-sharegpt-fp32-128-t08", *DATA],
}


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-").replace("--", "-")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/ablate")
    ap.add_argument("--data", nargs="+", default=DATA)
    ap.add_argument("--budget-cpu-minutes", type=float, default=10.0)
    ap.add_argument("--steps", type=int, default=None,
                    help="a fixed number of steps per run instead of the CPU budget (equal compute for levers that do not "
                    "change the step's cost, whatever else shares the machine)")
    ap.add_argument("--train-limit", type=int, default=600)
    ap.add_argument("--eval-sequences", type=int, default=32)
    ap.add_argument("--feature-cache-dir", default=None)
    ap.add_argument("--only", nargs="*", default=None, help="run only these settings (names as in the table)")
    ap.add_argument("--docs", default="docs/training", help="where the table, JSON and PNG go")
    ap.add_argument("--levers", action="store_true", help="the next levers against the current recipe (block 16, 4-5 layers) "
                    "instead of the recipe's own ablations; written as levers.{md,json,png}")
    cli, extra = ap.parse_known_args(argv)
    common = ["--data", *cli.data, "--mask-token-id", "16", "--max-response-tokens", "128", "--train-limit", str(cli.train_limit),
              "--eval-sequences", str(cli.eval_sequences), "--eval-every", "1000000", "--save-every", "50", "--precision", "fp32",
              *(["--max-steps", str(cli.steps)] if cli.steps else ["--budget-cpu-minutes", str(cli.budget_cpu_minutes), "--max-steps", "1000000"]),
              *extra]
    if cli.feature_cache_dir:
        common += ["--feature-cache-dir", cli.feature_cache_dir]
    out = Path(cli.out)
    every = LEVERS if cli.levers else RUNS
    runs = {name: flags for name, flags in every.items() if not cli.only or name in cli.only}
    t0 = time.time()
    # the stores the runs read, filled before them (one per data and response length: a fill of a full store is a no-op)
    for flags in runs.values():
        if "online" not in flags:
            train_main(common + FAST + flags + ["--out", str(out / "fill"), "--fill-features-only"])
    fills = {"features and teacher": time.time() - t0}
    print(f"feature stores ready in {fills['features and teacher']:.0f} s (wall, including the target load)", flush=True)
    results = {}
    for name, flags in every.items():  # the table holds every finished run in OUT; --only trains just those named
        run = out / slug(name)
        log = run / "log.jsonl"
        records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        done = records and (records[-1]["step"] >= cli.steps if cli.steps else records[-1].get("train_cpu_seconds", 0) >= cli.budget_cpu_minutes * 60)
        if not done and name in runs:
            train_main(common + flags + ["--out", str(run)])
            records = [json.loads(line) for line in log.read_text().splitlines()]
        elif not done:
            continue
        last = records[-1]
        results[name] = {"flags": flags, "steps": last["step"], "block_positions": last["block_positions"],
                         "train_cpu_seconds": last["train_cpu_seconds"], "dev": last["dev"]}
        print(f"{name}: {json.dumps(results[name]['dev'])}", flush=True)
    docs = Path(cli.docs)
    docs.mkdir(parents=True, exist_ok=True)
    summary = {"budget_cpu_minutes": None if cli.steps else cli.budget_cpu_minutes, "steps": cli.steps, "train_limit": cli.train_limit, "data": cli.data,
               "eval_sequences": cli.eval_sequences, "fill_wall_seconds": fills, "runs": results,
               "command": "python -m dflash2_tools.training.ablate " + " ".join(sys.argv[1:] if argv is None else argv)}
    name = ("levers" if cli.levers else "ablations") + (f"-{cli.steps}-steps" if cli.steps else "")
    (docs / f"{name}.json").write_text(json.dumps(summary, indent=1))
    (docs / f"{name}.md").write_text(table(summary))
    plot(summary, docs / f"{name}.png")
    print(table(summary))


def table(summary) -> str:
    rows = ["| setting | steps | block positions | on-policy acceptance (selector) | (argmax) | top-1 pos 1 | top-1 pos 7 |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in summary["runs"].items():
        dv = r["dev"]
        rows.append(f"| {name} | {r['steps']} | {r['block_positions']:,} | {dv.get('on_policy_acceptance_length_selector', float('nan')):.3f} "
                    f"| {dv['on_policy_acceptance_length_argmax']:.3f} | {dv['top1_per_position'][0]:.3f} | {dv['top1_per_position'][-1]:.3f} |")
    return "\n".join(rows) + "\n"


def plot(summary, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary["runs"])
    values = [summary["runs"][n]["dev"].get("on_policy_acceptance_length_selector", float("nan")) for n in names]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(names) + 1.2))
    ax.barh(names[::-1], values[::-1], color="tab:blue")
    for y, v in enumerate(values[::-1]):
        ax.text(v, y, f" {v:.3f}", va="center")
    ax.set_xlabel("on-policy acceptance length (tokens per target forward), dev")
    budget = f"{summary['steps']} steps" if summary.get("steps") else f"{summary['budget_cpu_minutes']:g} CPU-minutes"
    ax.set_title(f"Training levers at {budget} each, from scratch")
    ax.set_xlim(1.0, max(values) * 1.08 if values else 2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
