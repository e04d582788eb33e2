"""Ragged progress in one batch: cache slots every row writes, HOLES where a row did not keep what was written.

A batched step writes the same number of slots for every row, but each row keeps its own number of them. The slots
a row does not keep stay and become holes: the row's 2D mask (1 = a real entry) hides them, and its position ids
count real entries only, so the row attends to exactly the keys, at exactly the positions, it would see alone. Per
step only the tail is touched: ``crop_tail`` cuts the slots no row kept; ``kept_first`` moves each row's accepted
tree nodes to the front of its step's slots (a gather over those slots only); now and then (``should_compact``: a
quarter of the cache would be freed) ``compact`` moves every row's real entries together in ONE gather per layer;
``select_rows`` drops a finished row. ``DynamicLayer``s and static ``StaticLayer``s (preallocated: the length is set
in place, stale slots past it are hidden by the mask); a layer that keeps more than keys and values (windows,
recurrent states, indexers) is committed in lockstep instead (``loop_dflash2``) and only cropped or selected here.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer, StaticLayer

MIN_HOLES_TO_COMPACT = 32  # slots: below this a gather costs more than the holes do


def positions_from_mask(mask: torch.Tensor, start: torch.Tensor | None = None) -> torch.Tensor:
    """Position ids of new entries [b, n] from their 0/1 mask: ``start`` (real entries before them, [b]) plus the
    real entries before each one; a hole gets 0 (masked out anyway), as transformers' ``generate`` gives padding."""
    positions = mask.long().cumsum(-1) - 1  # [b, n]
    if start is not None:
        positions = positions + start.to(positions.device)[:, None]
    return positions.masked_fill(mask == 0, 0)


def kept_mask(kept: list[int], width: int, device) -> torch.Tensor:
    """[b, width] 0/1: row i keeps its first ``kept[i]`` of the step's ``width`` slots (built on the host: one copy)."""
    return torch.tensor([[1] * k + [0] * (width - k) for k in kept], device=device)


def crop_tail(cache, n: int) -> None:
    """Drop the last ``n`` slots of every layer (no row kept them). Other layers crop themselves: a sliding-window or
    linear-attention layer that records its past also shrinks back to its working size (even for ``n = 0``)."""
    for layer in cache.layers:
        if type(layer) is StaticLayer:
            if layer.is_initialized and n > 0:
                layer.cumulative_length.sub_(n)  # in place: the stale slots stay, past the length
        elif n > 0 or type(layer) is not DynamicLayer:
            layer.crop(-n)


def kept_first(cache, start: int, paths: list[list[int]], kept: int) -> torch.Tensor | None:
    """Move each row's accepted nodes (``paths[i]``: node indices from the anchor, in order) to the first ``kept``
    slots of the step (``start``...) in every layer, so that what follows is a chain's bookkeeping. Returns the order
    [b, kept] (slot j of row i now holds node ``order[i, j]``), or None when nothing had to move (every row's path
    is already its step's first slots: a chain, or a tree accepted along its first branch). Tail-only: the ``kept``
    leading slots of the step are written, nothing before ``start``."""
    order = [(path + list(range(len(path), kept)))[:kept] for path in paths]  # past a row's path: its own slots
    if all(row == list(range(kept)) for row in order):
        return None
    index = torch.tensor(order)  # [b, K]
    absolute = index + start  # [b, K] the slots to read
    expanded = {}  # (device, shape) -> the gather index [b, h, K, d]: built once, not once per layer
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        for name in ("keys", "values"):
            tensor = getattr(layer, name)  # [b, h, T, d]
            key = (tensor.device, tensor.shape[1], tensor.shape[3])
            if key not in expanded:  # the device differs only for a sharded target
                slots = absolute.to(tensor.device)
                expanded[key] = slots[0] if len(order) == 1 else slots[:, None, :, None].expand(*tensor.shape[:2], kept, tensor.shape[-1])
            # one row: a plain index_select [1, h, K, d]; else a gather [b, h, K, d]
            moved = tensor.index_select(2, expanded[key]) if len(order) == 1 else tensor.gather(2, expanded[key])
            tensor[:, :, start : start + kept] = moved
    return index


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
