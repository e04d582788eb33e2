"""Plots people would rather see than read.

    python -m dflash2_tools.plots learning-curve runs/smollm2/log.jsonl --out docs/learning_curve.png
    # a run continued with --init-from: give the logs in order, tokens and steps add up
    python -m dflash2_tools.plots learning-curve docs/train_log_smollm2.jsonl runs/smollm2-v2/log.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def learning_curve(log_paths, out: str | Path) -> list[dict]:
    """Dev acceptance length (argmax and selector drafts) vs training tokens; also writes the numbers as JSON.

    Several logs are consecutive runs (each started ``--init-from`` the previous one's weights).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, step0, tokens0 = [], 0, 0
    for run, path in enumerate([log_paths] if isinstance(log_paths, (str, Path)) else log_paths):
        records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        rows += [{**r, "run": run, "step": r["step"] + step0, "tokens_seen": r["tokens_seen"] + tokens0} for r in records]
        if records:
            step0, tokens0 = rows[-1]["step"], rows[-1]["tokens_seen"]
    points = [
        {
            "run": r["run"],
            "step": r["step"],
            "tokens_seen": r["tokens_seen"],
            "acceptance_argmax": r["dev"]["acceptance_length_argmax"],
            "acceptance_selector": r["dev"].get("acceptance_length_selector"),
            "top1_pos1": r["dev"]["top1_per_position"][0],
            "loss": r["loss"],
        }
        for r in rows
    ]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    xs = [p["tokens_seen"] / 1e6 for p in points]
    ax.plot(xs, [p["acceptance_argmax"] for p in points], "o-", label="argmax draft (DFlash-1 style)")
    if all(p["acceptance_selector"] is not None for p in points):
        ax.plot(xs, [p["acceptance_selector"] for p in points], "s-", label="selector walk (DFlash 2)")
    for run in sorted({p["run"] for p in points} - {0}):  # each continued run has its own (re-split) dev slice
        x0 = min(x for x, p in zip(xs, points) if p["run"] == run)
        ax.axvline(x0, color="grey", ls="--", lw=0.8)
        ax.annotate(f"run {run + 1}", (x0, 0.02), xycoords=("data", "axes fraction"), fontsize=8, color="grey")
    ax.set_xlabel("training tokens seen (millions, context tokens)")
    ax.set_ylabel("dev acceptance length (tokens / target forward)")
    ax.set_title("DFlash 2 drafter learning curve (held-out regenerated data)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    out.with_suffix(".json").write_text(json.dumps(points, indent=1))
    return points


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    lc = sub.add_parser("learning-curve")
    lc.add_argument("log", nargs="+", help="log.jsonl of a run; several: consecutive runs in order")
    lc.add_argument("--out", default="docs/learning_curve.png")
    args = ap.parse_args(argv)
    if args.cmd == "learning-curve":
        for p in learning_curve(args.log, args.out):
            print(p)


if __name__ == "__main__":
    main()
