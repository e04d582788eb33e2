"""Stage 4, batches: which sequences form step ``s``'s batch, and their padded tensors.

The batch order is a pure function of (seed, step), so a resumed run takes exactly the
batches an uninterrupted one would.
"""

from __future__ import annotations

import numpy as np
import torch


def collate(batch, pad_id: int):
    """[(tokens, prompt_len)] -> (tokens [b, T] right-padded, lengths [b], prompt lengths [b])."""
    lengths = torch.tensor([len(t) for t, _ in batch])
    prompt_lengths = torch.tensor([p for _, p in batch])
    tokens = torch.full((len(batch), int(lengths.max())), pad_id, dtype=torch.long)
    for i, (t, _) in enumerate(batch):
        tokens[i, : len(t)] = torch.as_tensor(np.asarray(t, dtype=np.int64))
    return tokens, lengths, prompt_lengths


def batch_indices(lengths, batch_size: int, step: int, seed: int, rank: int = 0, world: int = 1, bucket: int = 64) -> list[int]:
    """Indices of this rank's batch at ``step``, from the sequence ``lengths``.

    Every epoch is a permutation seeded by (seed, epoch), so a resumed run sees exactly the
    batches an uninterrupted one would. With ``bucket`` > 0 the permutation is cut into windows of
    ``bucket`` global batches, each window is sorted by length and the global batches are shuffled:
    sequences of similar length share a batch, so little compute goes to padding (measured on the
    shipped data, 4-sequence batches: padded / real tokens 1.44 in random batches, 1.01 with
    bucket 64), while an epoch still holds each sequence once. ``bucket=0``: plain random batches.
    """
    n_items, per_batch = len(lengths), batch_size * world
    per_epoch = max(n_items // per_batch, 1)
    epoch, within = divmod(step, per_epoch)
    rng = np.random.default_rng([seed, epoch])
    perm = rng.permutation(n_items)
    if bucket <= 0 or n_items < per_batch:
        start = (within * world + rank) * batch_size
        return perm[start : start + batch_size].tolist()
    lengths = np.asarray(lengths)
    window = bucket * per_batch
    perm = np.concatenate([w[np.argsort(lengths[w], kind="stable")] for w in np.split(perm, range(window, n_items, window))])
    batches = perm[: per_epoch * per_batch].reshape(per_epoch, per_batch)  # [global batches, world * batch_size]
    batch = batches[rng.permutation(per_epoch)[within]]
    return batch[rank * batch_size : (rank + 1) * batch_size].tolist()


def pad_stack(rows: list[torch.Tensor], width: int, fill=0) -> torch.Tensor:
    """[T_i, ...] tensors -> [b, width, ...], right-padded with ``fill``."""
    out = rows[0].new_full((len(rows), width, *rows[0].shape[1:]), fill)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out
