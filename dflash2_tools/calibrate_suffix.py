"""Calibrate the suffix index's acceptance estimates: P(token accepted) ~ count(token) / (count(parent) + s_k).

    python -m dflash2_tools.calibrate_suffix --out docs/suffix/calibration.json

An index over the TRAIN split of the regenerated responses; the held-out DEV split walked teacher-forced (at every
position of a dev response, the index's most frequent continuation of the context so far, compared with what the
target wrote next). Each proposed token is one observation of (match order k, parent count, child count,
accepted); s_k is the least-squares fit per order. The fitted values go into ``suffix_dflash2.SMOOTHING``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm import tqdm

from . import drafter as root
from .bench_suffix import SEED_DATA
from .regenerate import load_chunks
from .training.data import is_dev_sequence


def observations(folders: list[str], max_tokens: int, depth: int) -> dict:
    index = root.modeling().SuffixIndex(max_tokens=max_tokens, max_depth=depth)
    dev = []
    for i, (tokens, prompt_length) in enumerate(load_chunks(folders)):
        if is_dev_sequence(i):
            dev.append((tokens.tolist(), prompt_length))
        else:
            index.add(tokens[prompt_length:].tolist(), tokens[:prompt_length].tolist())
    seen: dict[tuple, list[int]] = {}  # (order, parent count, child count) -> [accepted, proposed]
    for tokens, prompt_length in tqdm(dev, desc="dev responses"):
        answer, context = tokens[prompt_length:], tokens[:prompt_length]
        for pos in range(len(answer)):
            trie = index.lookup(context[-max(index.orders):], depth)
            node = 0
            for j, token in enumerate(trie.best_path(depth)[0] if trie else []):
                if pos + j >= len(answer):
                    break
                child = trie.children[node][token]
                hit = token == answer[pos + j]
                cell = seen.setdefault((trie.match_length, trie.counts[node], trie.counts[child]), [0, 0])
                cell[0] += hit
                cell[1] += 1
                if not hit:
                    break
                node = child
            context.append(answer[pos])
    return seen


def fit(seen: dict) -> dict:
    """s_k per order: least squares of c / (n + s) against the observed acceptance, weighted by observations."""
    out = {}
    for k in sorted({key[0] for key in seen}):
        cells = [(n, c, a, m) for (kk, n, c), (a, m) in seen.items() if kk == k]
        grid = [i / 20 for i in range(20 * 8 + 1)]
        s = min(grid, key=lambda s: sum(m * (a / m - c / (n + s)) ** 2 for n, c, a, m in cells))
        out[k] = {"smoothing": s, "observations": sum(m for *_, m in cells),
                  "accepted_fraction": sum(a for _, _, a, _ in cells) / max(1, sum(m for *_, m in cells))}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", nargs="+", default=SEED_DATA)
    ap.add_argument("--max-tokens", type=int, default=1 << 21)
    ap.add_argument("--depth", type=int, default=12)
    ap.add_argument("--out", default="docs/suffix/calibration.json")
    args = ap.parse_args(argv)
    seen = observations([f for f in args.data if Path(f).is_dir()], args.max_tokens, args.depth)
    result = {"fit": fit(seen), "data": args.data, "cells": [[*key, *value] for key, value in sorted(seen.items())]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["fit"], indent=1))


if __name__ == "__main__":
    main()
