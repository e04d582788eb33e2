"""Pick a drafter's draft vocabulary: the token ids the target emits most in its own responses.

    python -m dflash2_tools.draft_vocab --data data/smollm2-sharegpt --size 8192 --drafter .

Counts response tokens of the TRAINING split of regenerated data (the same split train.py uses;
evaluation prompts are never in it), keeps the ``--size`` most frequent ids plus the drafter's
EOS ids, and writes them as ``draft_vocab_ids`` into the drafter's ``config.json``. Generation
then evaluates the target's LM head on those rows only (``DraftVocabHead``); ``--size 0``
removes the list (full-vocabulary drafting). Prints the share of training and dev response
tokens the list covers: a target token outside it cannot be drafted (verification stays exact).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from . import drafter as root
from .regenerate import load_chunks
from .training.data import is_dev_sequence


def response_token_counts(sequences, vocab_size: int, dev: bool) -> np.ndarray:
    """Occurrences of every token id in the responses of the train (or dev) split -> [vocab_size]."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for i, (tokens, prompt_len) in enumerate(sequences):
        if is_dev_sequence(i) == dev:
            np.add.at(counts, np.asarray(tokens[prompt_len:], dtype=np.int64), 1)
    return counts


def most_frequent_ids(counts: np.ndarray, size: int, always: list[int] = ()) -> list[int]:
    """The ``size`` most frequent ids (ties: lower id first) plus ``always``, sorted."""
    order = np.lexsort((np.arange(len(counts)), -counts))  # by count desc, then id asc
    ids = set(int(i) for i in order[:size]) | set(int(i) for i in always)
    return sorted(ids)


def coverage(counts: np.ndarray, ids: list[int]) -> float:
    total = int(counts.sum())
    return float(counts[ids].sum() / total) if total else float("nan")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, nargs="+",
                    help="folder(s) written by dflash2_tools.regenerate, read in the order given")
    ap.add_argument("--size", type=int, default=8192, help="number of most frequent ids to keep (0: full vocabulary)")
    ap.add_argument("--drafter", default=str(root.REPO_ROOT), help="drafter folder whose config.json is updated")
    args = ap.parse_args(argv)
    config = root.config_class().from_pretrained(args.drafter)
    if args.size < 0:
        raise ValueError(f"--size must be >= 0, got {args.size}")
    result = {"drafter": args.drafter, "size": args.size}
    if args.size == 0:
        config.draft_vocab_ids = None
    else:
        sequences = load_chunks(args.data)
        if not sequences:
            raise FileNotFoundError(f"no chunk_*.npz under {args.data}: run dflash2_tools.regenerate first")
        train_counts = response_token_counts(sequences, config.vocab_size, dev=False)
        dev_counts = response_token_counts(sequences, config.vocab_size, dev=True)
        eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
        ids = most_frequent_ids(train_counts, args.size, [i for i in eos if i is not None])
        config.draft_vocab_ids = ids
        config.validate_architecture()
        result.update(
            ids=len(ids),
            distinct_train_response_tokens=int((train_counts > 0).sum()),
            train_coverage=coverage(train_counts, ids),
            dev_coverage=coverage(dev_counts, ids),
        )
    config.save_pretrained(args.drafter)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
