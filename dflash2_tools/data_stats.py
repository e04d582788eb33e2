"""What regenerated data looks like: sizes, response lengths, and how much of it is loops.

    python -m dflash2_tools.data_stats --data data/smollm2-sharegpt data/smollm2-sharegpt-fp32-128

A small target's greedy responses often end in loops; repeated text is cheap to draft, so it
inflates acceptance measured on long responses. ``repeated_4gram_fraction`` is, per window of
response positions, the share of 4-grams that already occurred earlier in the same response,
over the responses that reach the end of that window.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from .regenerate import load_chunks


def repeated_ngram_flags(tokens, n: int = 4) -> np.ndarray:
    """[len - n + 1] bools: does the n-gram starting here occur earlier in ``tokens``?"""
    seen, flags = set(), []
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i : i + n])
        flags.append(gram in seen)
        seen.add(gram)
    return np.array(flags, dtype=bool)


def data_stats(sequences, windows=((0, 128), (128, 256)), n: int = 4) -> dict:
    prompt_lens = np.array([p for _, p in sequences])
    response_lens = np.array([len(t) - p for t, p in sequences])
    repeated = {}
    for lo, hi in windows:
        fractions = [repeated_ngram_flags(list(t[p:]), n)[lo : hi - n + 1].mean() for t, p in sequences if len(t) - p >= hi]
        repeated[f"{lo}-{hi}"] = {"responses": len(fractions), "fraction": round(float(np.mean(fractions)), 3) if fractions else None}
    return {
        "sequences": len(sequences),
        "response_tokens": int(response_lens.sum()),
        "prompt_tokens_mean": round(float(prompt_lens.mean()), 1),
        "response_tokens_mean": round(float(response_lens.mean()), 1),
        "response_tokens_max": int(response_lens.max()),
        "share_at_max": round(float((response_lens == response_lens.max()).mean()), 3),
        f"repeated_{n}gram_fraction": repeated,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, nargs="+", help="folder(s) written by dflash2_tools.regenerate")
    args = ap.parse_args(argv)
    sequences = load_chunks(args.data)
    if not sequences:
        raise SystemExit(f"no chunk_*.npz under {args.data}: run dflash2_tools.regenerate first")
    print(json.dumps({"data": args.data, **data_stats(sequences)}, indent=1))


if __name__ == "__main__":
    main()
