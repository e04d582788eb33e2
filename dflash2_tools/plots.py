"""Plots people would rather see than read.

    python -m dflash2_tools.plots learning-curve runs/smollm2/log.jsonl --out docs/learning_curve.png
    # a run continued with --init-from: give the logs in order, tokens and steps add up
    python -m dflash2_tools.plots learning-curve docs/train_log_smollm2.jsonl runs/smollm2-v2/log.jsonl
    # the plain-call acceptance of each shipped run against the tokens all runs so far trained on
    python -m dflash2_tools.plots acceptance-history docs/training/history.json --out docs/training/acceptance_history.png
    # the same per evaluation set (HumanEval, CHAMP, ShareGPT-dev) for the runs that measured them, against their goals
    python -m dflash2_tools.plots per-set-history docs/training/history_code_math.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of a training log (one JSON object per line, blank lines skipped)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def save_figure(fig, out: str | Path, data) -> None:
    """The PNG at ``out`` and the numbers drawn, as JSON, beside it (``.json``)."""
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1))


def learning_curve(log_paths, out: str | Path, names: list[str] | None = None) -> list[dict]:
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
        records = read_jsonl(path)
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
            ax.annotate(names[run] if names else f"run {run + 1}", (x0, 0.02), xycoords=("data", "axes fraction"), fontsize=8, color="grey")
        ax.set_xlabel(label)
        ax.set_ylabel(f"dev acceptance length, {'on-policy' if on_policy else 'random anchors'}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("DFlash 2 drafter learning curve (held-out regenerated data)")
    save_figure(fig, out, points)
    return points


def log_linear_fit(xs, ys) -> tuple[float, float]:
    """Least squares ``y = a + b * log2(x)`` -> (a, b)."""
    lx = [math.log2(x) for x in xs]
    mx, my = sum(lx) / len(lx), sum(ys) / len(ys)
    b = sum((u - mx) * (v - my) for u, v in zip(lx, ys)) / sum((u - mx) ** 2 for u in lx)
    return my - b * mx, b


def tokens_for_goal(intercept: float, per_doubling: float, goal: float) -> float:
    """Where ``intercept + per_doubling * log2(tokens)`` reaches ``goal`` (infinite for a flat or falling fit)."""
    return 2 ** ((goal - intercept) / per_doubling) if per_doubling > 0 else float("inf")


def cumulative_tokens(history_path: Path, runs: list[dict]) -> list[int]:
    """Training tokens of all runs up to and including each one: a run's are its log's last ``tokens_seen``
    (``log`` relative to the history file; an absolute path stays absolute)."""
    totals, total = [], 0
    for run in runs:
        total += read_jsonl(history_path.parent / run["log"])[-1]["tokens_seen"]
        totals.append(total)
    return totals


def acceptance_history(history_path: str | Path, out: str | Path, goal: float = 3.0) -> dict:
    """Plain-call acceptance of consecutive runs against cumulative training tokens (log scale).

    ``history.json``: ``{"runs": [{"name", "log", "plain_call_acceptance"}, ...]}`` in training order,
    each run continuing the previous weights; a run's tokens are its log's last ``tokens_seen``.
    Fits acceptance = a + b log2(tokens) and says how many tokens the fit needs to reach ``goal``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history_path = Path(history_path)
    runs = json.loads(history_path.read_text())["runs"]
    xs = cumulative_tokens(history_path, runs)
    ys = [run["plain_call_acceptance"] for run in runs]
    if len(xs) < 2:
        raise ValueError(f"{history_path}: a fit needs at least two runs, got {len(xs)}")
    a, b = log_linear_fit(xs, ys)
    needed = tokens_for_goal(a, b, goal)
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot([x / 1e6 for x in xs], ys, "o-", label="shipped runs (plain call, 12 ShareGPT-dev prompts, fp32)")
    for x, y, run in zip(xs, ys, runs):
        ax.annotate(run["name"], (x / 1e6, y), textcoords="offset points", xytext=(4, -10), fontsize=8)
    grid = [xs[0] * (needed / xs[0]) ** (i / 40) for i in range(41)] if needed < float("inf") else xs
    ax.plot([x / 1e6 for x in grid], [a + b * math.log2(x) for x in grid], "--", color="grey",
            label=f"fit: {b:+.3f} per doubling of tokens")
    ax.axhline(goal, color="red", lw=0.8, ls=":", label=f"goal {goal:g}")
    ax.set_xscale("log")
    ax.set(xlabel="cumulative training tokens (millions, context tokens; log scale)", ylabel="accepted tokens per target forward",
           title="Plain-call acceptance against training tokens (log-linear)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    result = {"cumulative_tokens": xs, "plain_call_acceptance": ys, "fit_intercept": a, "fit_per_doubling": b,
              "goal": goal, "tokens_for_goal_by_fit": needed}
    save_figure(fig, out, result)
    return result


def per_set_history(history_path: str | Path, out: str | Path, goals: dict[str, float]) -> dict:
    """Plain-call acceptance on each evaluation set across the runs that measured it, against cumulative training
    tokens (log scale), with a log-linear fit per set over those runs and where each fit meets its goal.

    ``history.json`` as for :func:`acceptance_history`; a run that measured the sets carries
    ``"per_set": {"humaneval": "path/to/acceptance.json", ...}`` (files written by ``python -m
    dflash2_tools.acceptance``, paths relative to the history file), and only those runs are drawn.
    """
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history_path = Path(history_path)
    runs = json.loads(history_path.read_text())["runs"]
    points = []  # (cumulative tokens, run name, {set: acceptance})
    for total, run in zip(cumulative_tokens(history_path, runs), runs):
        if "per_set" in run:
            sets = {name: json.loads((history_path.parent / path).read_text())["mean_acceptance_length"]
                    for name, path in run["per_set"].items()}
            points.append((total, run["name"], sets))
    missing = [name for name in goals if sum(name in sets for _, _, sets in points) < 2]
    if missing:
        raise ValueError(f"{history_path}: a fit needs two runs that measured each set; too few for {missing}")
    fig, ax = plt.subplots(figsize=(9.0, 4.4))
    result = {"runs": [name for _, name, _ in points], "cumulative_tokens": [x for x, _, _ in points], "sets": {}}
    for index, (name, goal) in enumerate(goals.items()):
        color = f"C{index % 10}"  # matplotlib's default cycle: every set drawn, however many
        xs = [x for x, _, sets in points if name in sets]
        ys = [sets[name] for _, _, sets in points if name in sets]
        a, b = log_linear_fit(xs, ys)
        needed = tokens_for_goal(a, b, goal)
        result["sets"][name] = {"acceptance": ys, "fit_intercept": a, "fit_per_doubling": b, "goal": goal,
                                "tokens_for_goal_by_fit": needed}
        ax.plot([x / 1e6 for x in xs], ys, "o-", color=color, label=f"{name} ({b:+.3f} per doubling)")
        ax.axhline(goal, color=color, lw=0.8, ls=":", label=f"{name} goal {goal:g}")
        ax.plot([x / 1e6 for x in xs], [a + b * math.log2(x) for x in xs], "--", color=color, lw=0.8)
    for x, run_name, _ in points:
        ax.annotate(run_name, (x / 1e6, ax.get_ylim()[0]), textcoords="offset points", xytext=(2, 4), fontsize=7, rotation=90)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set(xlabel="cumulative training tokens (millions; log scale)", ylabel="accepted tokens per target forward",
           title="Plain-call acceptance per set (dotted: goals; dashed: log-linear fits)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: the points fill the axes
    save_figure(fig, out, result)
    return result


def parse_goals(pairs: list[str]) -> dict[str, float]:
    """``["humaneval=2.0", ...]`` -> ``{"humaneval": 2.0, ...}``, with an error that names a malformed pair."""
    goals = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        try:
            goals[name] = float(value)
        except ValueError:
            name = ""
        if not name:
            raise ValueError(f"--goals takes SET=NUMBER pairs such as humaneval=2.0; got {pair!r}")
    return goals


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    lc = sub.add_parser("learning-curve")
    lc.add_argument("log", nargs="+", help="log.jsonl of a run; several: consecutive runs in order")
    lc.add_argument("--out", default="docs/learning_curve.png")
    lc.add_argument("--names", nargs="*", default=None, help="a label per log (default: run 1, run 2, ...)")
    ah = sub.add_parser("acceptance-history")
    ah.add_argument("history", help="history.json: the shipped runs in order, their logs and plain-call acceptance")
    ah.add_argument("--out", default="docs/training/acceptance_history.png")
    ah.add_argument("--goal", type=float, default=3.0)
    ps = sub.add_parser("per-set-history")
    ps.add_argument("history", help="history.json whose runs carry per_set acceptance files")
    ps.add_argument("--out", default="docs/training/acceptance_per_set.png")
    ps.add_argument("--goals", nargs="+", default=["humaneval=2.0", "champ=1.9", "sharegpt-dev=1.9"],
                    help="SET=GOAL for each set to draw (default: issue 29's goals)")
    args = ap.parse_args(argv)
    if args.cmd == "learning-curve":
        if args.names and len(args.names) != len(args.log):
            ap.error(f"--names gives {len(args.names)} labels for {len(args.log)} logs")
        for p in learning_curve(args.log, args.out, args.names):
            print(p)
    elif args.cmd == "acceptance-history":
        r = acceptance_history(args.history, args.out, args.goal)
        print(f"fit: acceptance = {r['fit_intercept']:.3f} + {r['fit_per_doubling']:.3f} log2(tokens); "
              f"{args.goal:g} reached at {r['tokens_for_goal_by_fit'] / 1e6:,.0f}M training tokens "
              f"({r['tokens_for_goal_by_fit'] / r['cumulative_tokens'][-1]:.0f}x all runs so far)")
    elif args.cmd == "per-set-history":
        try:
            goals = parse_goals(args.goals)
        except ValueError as err:
            ap.error(str(err))
        r = per_set_history(args.history, args.out, goals)
        for name, fit in r["sets"].items():
            where = (f"at or above its goal {fit['goal']:g} now" if fit["acceptance"][-1] >= fit["goal"] else
                     f"goal {fit['goal']:g} reached at {fit['tokens_for_goal_by_fit'] / 1e6:,.1f}M training tokens by the "
                     f"fit ({fit['tokens_for_goal_by_fit'] / r['cumulative_tokens'][-1]:.2f}x all runs so far)")
            print(f"{name}: last {fit['acceptance'][-1]:.3f}, fit {fit['fit_per_doubling']:+.3f} per doubling of tokens; {where}")


if __name__ == "__main__":
    main()
