"""The model card's numbers, generated from committed result files (so the README cannot drift from them).

    python -m dflash2_tools.card                 # print the README blocks from the committed results
    python -m dflash2_tools.card --write         # rewrite those blocks in README.md
    python -m dflash2_tools.card --check         # exit 1 when README.md differs from what the results give (CI)

Each block sits between ``<!-- card:NAME -->`` and ``<!-- /card:NAME -->`` in README.md:

* ``results``: the speedup table of one benchmark run (``RESULTS``: ``python -m dflash2_tools.benchmark ... --out
  docs/results``), with the machine it ran on (CPU model and flags, recorded by the benchmark) and the command;
* ``acceptance``: the shipped weights' tokens per target forward through the plain call (``ACCEPTANCE`` files of
  ``python -m dflash2_tools.acceptance``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results" / "results.json"
ACCEPTANCE = {name: REPO / "docs" / "acceptance" / f"code-math-v9-{key}.json"
              for name, key in (("HumanEval", "humaneval"), ("CHAMP", "champ"), ("ShareGPT-dev", "sharegpt-dev"))}
SET_NAMES = {"humaneval": "HumanEval", "champ": "CHAMP", "sharegpt-dev": "ShareGPT-dev"}
METHOD_NAMES = {
    "target": "transformers target alone",
    "pld": "prompt lookup (transformers, `prompt_lookup_num_tokens=10`)",
    "dflash2": "DFlash 2 block draft only (`prompt_lookup_num_tokens=0`)",
    "dflash2+ngram": "**DFlash 2, the plain call (default)**",
    "dflash2-tree+ngram": "DFlash 2 tree of 16 nodes + n-gram branch (`tree_budget=16`)",
    "dflash2-tree": "DFlash 2 tree of 16 nodes (`tree_budget=16`, n-gram off)",
}
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def machine_info() -> dict:
    """What the benchmark ran on: CPU model, the flags that decide fp32 / bf16 speed, cores, library versions."""
    import torch
    import transformers

    model, flags = platform.processor() or "unknown CPU", set()
    try:
        text = Path("/proc/cpuinfo").read_text()
        model = re.search(r"model name\s*:\s*(.+)", text).group(1).strip()
        flags = set(re.search(r"flags\s*:\s*(.+)", text).group(1).split())
    except (OSError, AttributeError):
        pass
    return {"cpu": model, "cpu_flags": [f for f in CPU_FLAGS if f in flags], "cores": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "torch": torch.__version__, "transformers": transformers.__version__}


def results_block(saved: dict) -> str:
    """The Results table: per set, median speedup over the target alone and tokens per target forward."""
    args, rows = saved["args"], saved["summary"]
    sets = list(args["prompt_sets"])
    cell = {(r["prompt_set"], r["method"]): r for r in rows if r["temperature"] == 0}
    methods = [m for m in METHOD_NAMES if any((s, m) in cell for s in sets)]
    machine = saved.get("machine") or {}
    lines = [f"| method | {' | '.join(SET_NAMES.get(s, s) for s in sets)} |", "| --- |" + " ---: |" * len(sets)]
    for m in methods:
        values = []
        for s in sets:
            r = cell.get((s, m))
            values.append("" if r is None else f"{r['median_speedup']:.2f}x ({r['mean_acceptance_length']:.2f})")
        lines.append(f"| {METHOD_NAMES[m]} | {' | '.join(values)} |")
    base = [cell[(s, 'target')]['median_tok_per_s'] for s in sets if (s, "target") in cell]
    lossless = [r["lossless"] for r in rows if r["method"] != "target" and r["temperature"] == 0]
    same = sum(int(x.split("/")[0]) for x in lossless), sum(int(x.split("/")[1]) for x in lossless)
    flags = ", ".join(machine.get("cpu_flags", [])) or "unknown"
    command = ("python -m dflash2_tools.benchmark --prompt-sets " + " ".join(sets) + f" --limit {args['limit']} --dtypes "
               + " ".join(args["dtypes"]) + " --temperatures 0 --methods " + " ".join(args["methods"])
               + f" --out {args['out']}")
    fastest = sum(1 for s in sets if (s, "dflash2+ngram") in cell and cell[(s, "dflash2+ngram")]["median_speedup"]
                  >= max(cell[(s, m)]["median_speedup"] for m in methods if (s, m) in cell))
    return "\n".join([
        f"Speedup over the transformers target alone (tokens per target forward in brackets): greedy, {args['dtypes'][0]}, "
        f"{args['max_new_tokens']} new tokens, the first {args['limit']} prompts of each set, medians of per-prompt ratios, "
        f"every method per prompt in one run after a warm-up. Machine: {machine.get('cpu', 'unknown')} "
        f"({machine.get('cores', '?')} cores; flags: {flags}), torch {machine.get('torch', '?')}, transformers "
        f"{machine.get('transformers', '?')}; the target alone decodes {min(base):.1f}-{max(base):.1f} tokens/s there. "
        f"Greedy outputs equal to the target's: {same[0]}/{same[1]}.",
        "",
        "```bash",
        command,
        "```",
        "",
        *lines,
        "",
        f"What it means: on this machine the plain call, with no setting changed, is the fastest of these methods on "
        f"{fastest} of {len(sets)} prompt sets, and every output is the target's own (the plot at the top draws the same runs).",
    ])


def acceptance_block(files: dict[str, Path]) -> str:
    """Tokens per target forward of the shipped weights through the plain call, per evaluation set."""
    found = {name: json.loads(path.read_text()) for name, path in files.items()}
    first = next(iter(found.values()))
    figures = ", ".join(f"{name} {d['mean_acceptance_length']:.2f}" for name, d in found.items())
    return (f"Tokens per target forward of the shipped weights (block draft alone, whole block verified, greedy, "
            f"{first['dtype']}, {first['prompts']} prompts per set, {first['max_new_tokens']} new tokens): {figures} "
            f"(`python -m dflash2_tools.acceptance --prompt-set SET --limit {first['prompts']} --dtype {first['dtype']}`).")


def blocks(results: Path = RESULTS, acceptance: dict[str, Path] = ACCEPTANCE) -> dict[str, str]:
    return {"results": results_block(json.loads(results.read_text())), "acceptance": acceptance_block(acceptance)}


def replace_blocks(text: str, generated: dict[str, str]) -> str:
    """``text`` with every ``<!-- card:NAME -->`` block replaced; a missing marker is an error (names the block)."""
    for name, body in generated.items():
        pattern = re.compile(rf"(<!-- card:{name} -->\n)(?:.*?\n)?(<!-- /card:{name} -->)", re.S)
        if not pattern.search(text):
            raise ValueError(f"README.md has no '<!-- card:{name} -->' ... '<!-- /card:{name} -->' block to fill")
        text = pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--readme", default=str(REPO / "README.md"))
    ap.add_argument("--results", default=str(RESULTS))
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the README's generated blocks")
    mode.add_argument("--check", action="store_true", help="exit 1 when the README's blocks differ from the results")
    args = ap.parse_args(argv)
    generated = blocks(Path(args.results))
    readme = Path(args.readme)
    if not (args.write or args.check):
        print("\n\n".join(f"<!-- card:{k} -->\n{v}\n<!-- /card:{k} -->" for k, v in generated.items()))
        return 0
    text = readme.read_text()
    updated = replace_blocks(text, generated)
    if args.write:
        readme.write_text(updated)
        return 0
    if updated != text:
        print(f"{readme} differs from what the committed results give: run python -m dflash2_tools.card --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
