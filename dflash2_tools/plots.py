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
    """Dev acceptance length vs training tokens and vs training CPU-hours; also writes the numbers as JSON.

    Several logs are consecutive runs (each started ``--init-from`` the previous one's weights):
    steps, tokens and CPU time add up. The on-policy figure (what the plain call measures) is
    plotted where a log has it, random-anchor acceptance otherwise (runs before that metric).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, step0, tokens0, cpu0 = [], 0, 0, 0.0
    for run, path in enumerate([log_paths] if isinstance(log_paths, (str, Path)) else log_paths):
        records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        timed = any("train_cpu_seconds" in r for r in records)  # a run's baseline record (step 0) sits at its start
        rows += [{**r, "run": run, "step": r["step"] + step0, "tokens_seen": r["tokens_seen"] + tokens0,
                  "cpu_hours": (r.get("train_cpu_seconds", 0.0) + cpu0) / 3600 if timed else None} for r in records]
        if records:
            step0, tokens0 = rows[-1]["step"], rows[-1]["tokens_seen"]
            cpu0 = (rows[-1]["cpu_hours"] or 0.0) * 3600
    points = []
    for r in rows:
        dv = r["dev"]
        points.append({
            "run": r["run"], "step": r["step"], "tokens_seen": r["tokens_seen"], "cpu_hours": r["cpu_hours"],
            "acceptance_argmax": dv["acceptance_length_argmax"], "acceptance_selector": dv.get("acceptance_length_selector"),
            "on_policy_selector": dv.get("on_policy_acceptance_length_selector"),
            "on_policy_argmax": dv.get("on_policy_acceptance_length_argmax"),
            "top1_pos1": dv["top1_per_position"][0], "loss": r["loss"],
        })
    on_policy = all(p["on_policy_argmax"] is not None for p in points)
    key = "on_policy_" if on_policy else "acceptance_"
    with_cpu = [p for p in points if p["cpu_hours"] is not None]
    panels = [("tokens_seen", 1e6, "training tokens seen (millions, context tokens)", points)]
    if with_cpu:
        panels.append(("cpu_hours", 1.0, "training CPU-hours (process CPU time, all threads)", with_cpu))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.0), squeeze=False)
    for ax, (field, scale, label, pts) in zip(axes[0], panels):
        xs = [p[field] / scale for p in pts]
        ax.plot(xs, [p[key + "argmax"] for p in pts], "o-", label="argmax draft (DFlash-1 style)")
        if all(p[key + "selector"] is not None for p in pts):
            ax.plot(xs, [p[key + "selector"] for p in pts], "s-", label="selector walk (DFlash 2)")
        for run in sorted({p["run"] for p in pts} - {pts[0]["run"]}):  # each continued run has its own (re-split) dev slice
            x0 = min(x for x, p in zip(xs, pts) if p["run"] == run)
            ax.axvline(x0, color="grey", ls="--", lw=0.8)
            ax.annotate(f"run {run + 1}", (x0, 0.02), xycoords=("data", "axes fraction"), fontsize=8, color="grey")
        ax.set_xlabel(label)
        ax.set_ylabel(f"dev acceptance length, {'on-policy' if on_policy else 'random anchors'}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("DFlash 2 drafter learning curve (held-out regenerated data)")
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
