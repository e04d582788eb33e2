"""Ragged progress in one batch: cache slots every row writes, HOLES where a row did not keep what was written.

A batched step writes the same number of cache slots for every row (a forward is rectangular), but each row keeps
its own number of them. The slots a row does not keep stay where they are and become holes: the row's 2D mask
(1 = a real entry) zeroes them from then on, and its position ids count real entries only, so the row attends to
exactly the keys, at exactly the positions, it would see alone. What is touched per step is the tail only:

* ``crop_tail``: the slots NO row kept are cut off the end (every row's cache ends at its longest keeper);
* ``compact``: now and then (``should_compact``: the holes would free a quarter of the cache), ONE gather per
  layer moves every row's real entries together, right-aligned; the cost is one pass over the cache, amortised
  over the steps that made the holes;
* ``select_rows``: a row that finished leaves the batch; its slice of every cache is dropped;
* ``kept_first``: a step that verified a tree per row first moves each row's accepted nodes to the front of the
  step's slots (a gather over those slots only), so that what follows is a chain's bookkeeping.

Works on ``DynamicLayer`` caches (the target's full-attention layers, the drafter's context cache) and on a static
cache's ``StaticLayer``s (preallocated: the tail is cut by setting the layer's length in place, compaction writes the
gathered entries back into the first slots; the slots past the length are stale, and the 2D mask, which ends at the
length, hides them); a layer that keeps more than keys and values (sliding windows, recurrent states, indexers) is
committed in lockstep instead (``loop_dflash2``: no holes), and these functions only crop or select its rows.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import StaticLayer

MIN_HOLES_TO_COMPACT = 32  # slots: below this a gather costs more than the holes do


def positions_from_mask(mask: torch.Tensor, start: torch.Tensor | None = None) -> torch.Tensor:
    """Position ids of new entries [b, n] from their 0/1 mask: ``start`` (real entries before them, [b]) plus the
    real entries before each one; a hole gets 0 (masked out anyway), as transformers' ``generate`` gives padding."""
    positions = mask.long().cumsum(-1) - 1  # [b, n]
    if start is not None:
        positions = positions + start.to(positions.device)[:, None]
    return positions.masked_fill(mask == 0, 0)


def kept_mask(kept: list[int], width: int, device) -> torch.Tensor:
    """[b, width] 0/1: row i keeps its first ``kept[i]`` of the step's ``width`` slots."""
    return (torch.arange(width, device=device)[None] < torch.tensor(kept, device=device)[:, None]).long()


def crop_tail(cache, n: int) -> None:
    """Drop the last ``n`` slots of every layer (no row kept them). Other layers crop themselves: a sliding-window or
    linear-attention layer that records its past also shrinks back to its working size (even for ``n = 0``)."""
    for layer in cache.layers:
        if type(layer) is StaticLayer:
            if layer.is_initialized and n > 0:
                layer.cumulative_length.sub_(n)  # in place: the stale slots stay, past the length
        else:
            layer.crop(-n)


def kept_first(cache, start: int, order: torch.Tensor) -> None:
    """Reorder the step's slots ``start..start+W`` of every row by ``order`` [b, W] (a permutation per row: the row's
    kept tree nodes first, in path order), so that each row's kept entries lead its step's slots as a chain's do.
    Tail-only: nothing before ``start`` is touched."""
    width = order.shape[1]
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        index = order.to(layer.keys.device)[:, None, :, None]  # [b, 1, W, 1]
        for name in ("keys", "values"):
            tensor = getattr(layer, name)
            step = tensor[:, :, start : start + width]  # [b, h, W, d]
            tensor[:, :, start : start + width] = step.gather(2, index.expand(*step.shape[:2], width, step.shape[-1]))


def should_compact(length: int, real: list[int]) -> bool:
    """Compact when the holes would free at least a quarter of a cache ``length`` slots long (and a minimum)."""
    freed = length - max(real, default=0)
    return freed >= max(MIN_HOLES_TO_COMPACT, length // 4)


def compact(cache, mask: torch.Tensor) -> torch.Tensor:
    """Move each row's real entries together, right-aligned, in order; returns the new mask [b, T'].

    T' is the most real entries any row has; a shorter row gets holes on the left (like left padding)."""
    counts = mask.sum(-1)  # [b]
    width = int(counts.max())
    # a stable sort of the 0/1 mask puts each row's holes first and its real entries last, both in order
    order = torch.sort(mask.to(torch.int8), dim=-1, stable=True).indices[:, -width:]  # [b, T']
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        index = order.to(layer.keys.device)[:, None, :, None]  # [b, 1, T', 1]
        keys = layer.keys.gather(2, index.expand(*layer.keys.shape[:2], width, layer.keys.shape[-1]))  # [b, h, T', d]
        values = layer.values.gather(2, index.expand(*layer.values.shape[:2], width, layer.values.shape[-1]))
        if type(layer) is StaticLayer:  # back into the first slots, in place
            layer.keys[:, :, :width], layer.values[:, :, :width] = keys, values
            layer.cumulative_length.fill_(width)
        else:
            layer.keys, layer.values = keys, values
    return mask.gather(-1, order)


def select_rows(cache, rows: torch.Tensor) -> None:
    """Keep only batch rows ``rows`` (indices into the current batch) in every layer (sliding windows and recurrent
    states included: their own ``reorder_cache``)."""
    for layer in cache.layers:
        if type(layer) is StaticLayer:
            if layer.is_initialized:
                index = rows.to(layer.keys.device)
                layer.keys = layer.keys.index_select(0, index)  # new (smaller) tensors: eager calls only
                layer.values = layer.values.index_select(0, index)
                layer.batch_size = len(rows)
        else:
            layer.reorder_cache(rows)


__all__ = ["compact", "crop_tail", "kept_first", "kept_mask", "positions_from_mask", "select_rows", "should_compact"]
