"""Stage 1, data: the regenerated (prompt, response) ids, split into train and dev.

The dev slice is every 50th regenerated sequence in chunk order, so adding folders or
chunks never moves a sequence between the splits; ``draft_vocab`` counts the same train split.
"""

from __future__ import annotations

from ..regenerate import load_chunks

DEV_EVERY = 50  # every 50th regenerated sequence is held out for the training-time dev evaluation


def is_dev_sequence(index: int) -> bool:
    """Whether regenerated sequence ``index`` (chunk order) is in the held-out dev slice."""
    return index % DEV_EVERY == DEV_EVERY - 1


def split_sequences(sequences, max_len: int, max_response_tokens: int | None = None):
    """(train, dev) lists of (tokens, prompt length), each cut to ``max_len`` tokens and to
    ``max_response_tokens`` response tokens; sequences with fewer than 2 response tokens are dropped."""
    train, dev = [], []
    for i, (tokens, prompt_len) in enumerate(sequences):
        tokens = tokens[: min(max_len, prompt_len + max_response_tokens) if max_response_tokens else max_len]
        if len(tokens) - prompt_len < 2:
            continue
        (dev if is_dev_sequence(i) else train).append((tokens, prompt_len))
    return train, dev


def load_split(folders, max_len: int, max_response_tokens: int | None = None):
    """Read the regenerated folders (in the order given) and split them into (train, dev)."""
    train, dev = split_sequences(load_chunks(folders), max_len, max_response_tokens)
    if not train:
        raise SystemExit(f"no training sequences in {folders}: run python -m dflash2_tools.regenerate first")
    return train, dev
