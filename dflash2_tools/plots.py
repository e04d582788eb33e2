"""Plots people would rather see than read.

    python -m dflash2_tools.plots learning-curve runs/smollm2/log.jsonl --out docs/learning_curve.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def learning_curve(log_path: str | Path, out: str | Path) -> list[dict]:
    """Dev acceptance length (argmax and selector drafts) vs training tokens; also writes the numbers as JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(log_path).read_text().splitlines() if line.strip()]
    points = [
        {
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
    lc.add_argument("log")
    lc.add_argument("--out", default="docs/learning_curve.png")
    args = ap.parse_args(argv)
    if args.cmd == "learning-curve":
        for p in learning_curve(args.log, args.out):
            print(p)


if __name__ == "__main__":
    main()
