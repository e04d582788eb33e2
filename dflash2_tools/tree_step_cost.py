"""Does a tree step's work grow with the context? One verification forward over a tree plus the cache compaction,
timed at two context lengths, with today's tail-only compaction and the whole-cache one it replaced.

    python -m dflash2_tools.tree_step_cost --contexts 256 2048 --nodes 16 --out docs/tree/step_vs_context.json

The embedded target with ``--context`` committed tokens in its dynamic cache; each repeat runs ONE forward over a
random ``--nodes``-node tree under the tree mask (as tree verification does: through ``verification_attention``'s
packed GQA heads, or through transformers' SDPA, which copies every cached K/V per layer for a masked
multi-query forward), keeps a 3-node path the way the loop does (``holes_dflash2.kept_first`` then ``crop_tail``, tail-only: the kept
nodes' K/V move to the front of the step's slots and the rest is cut off) or with the former whole-cache ``index_select`` of every layer, then crops back to
the context. Fastest repeat (and the median) after a warm-up. What remains context-dependent is the forward itself: attention over the
context, and transformers' ``DynamicLayer.update``, which concatenates the new K/V onto the whole cache.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

from . import drafter as root
from .target import load_target
from .tree_cost import random_tree


def tail_only_compaction(cache, past: int, keep: list[int], width: int) -> None:
    """What the loop does after a tree step: the kept nodes first in the step's slots, the rest cut off."""
    holes = root.holes()
    holes.kept_first(cache, past, [keep], kept=len(keep))
    holes.crop_tail(cache, width - len(keep))


def whole_cache_compaction(cache, past: int, keep: list[int], width: int) -> None:
    """The compaction tree mode used before: an index_select over EVERY cached position of every layer."""
    index = torch.cat([torch.arange(past), past + torch.tensor(keep, dtype=torch.long)])
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(-2, index)
        layer.values = layer.values.index_select(-2, index)


@torch.no_grad()
def time_step(target, tree_module, context: int, nodes: int, compaction, repeats: int, packed: bool = True) -> dict:
    from transformers.cache_utils import DynamicCache

    g = torch.Generator().manual_seed(0)
    cache = DynamicCache()
    target(input_ids=torch.randint(2, 1000, (1, context), generator=g), past_key_values=cache, use_cache=True, logits_to_keep=1)
    tree = random_tree(tree_module, nodes, 1000, g)
    keep = [0, 2, 3]  # a path that is not the first slots: its K/V move
    forward_s, compact_s = [], []
    for _ in range(repeats + 1):
        mask = tree_module.tree_attention_mask(tree, torch.ones(context, dtype=torch.long), target.dtype)
        t0 = time.perf_counter()
        with root.attention().verification_attention(target) if packed else contextlib.nullcontext():
            target(input_ids=torch.tensor([tree.tokens]), position_ids=(context + torch.tensor(tree.depths))[None],
                   attention_mask=mask, past_key_values=cache, use_cache=True)
        t1 = time.perf_counter()
        compaction(cache, context, keep, len(tree))
        t2 = time.perf_counter()
        cache.crop(-len(keep))
        forward_s.append(t1 - t0)
        compact_s.append(t2 - t1)
    # the fastest repeat: on a shared 2-core VM the same forward varied by 20% between runs (noise only adds time)
    return {"forward_ms": 1e3 * min(forward_s[1:]), "compaction_ms": 1e3 * min(compact_s[1:]),
            "forward_median_ms": 1e3 * statistics.median(forward_s[1:])}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", nargs=2, type=int, default=[256, 2048])
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, _ = load_target(dtype=torch.float32)
    tree_module = root.tree()
    result = {"nodes": args.nodes, "contexts": args.contexts, "rows": {}}
    variants = (("tail-only", tail_only_compaction, True),  # the loop today: packed GQA heads
                ("tail-only, transformers' SDPA", tail_only_compaction, False),  # repeat_kv per layer
                ("whole-cache, transformers' SDPA", whole_cache_compaction, False))  # before both
    for name, compaction, packed in variants:
        rows = {c: time_step(target, tree_module, c, args.nodes, compaction, args.repeats, packed) for c in args.contexts}
        small, large = (rows[c] for c in args.contexts)
        ratio = (large["forward_ms"] + large["compaction_ms"]) / (small["forward_ms"] + small["compaction_ms"])
        result["rows"][name] = {"by_context": rows, "step_ratio": ratio}
        print(f"{name:31s}: " + "  ".join(f"context {c}: forward {r['forward_ms']:.1f} ms + compaction {r['compaction_ms']:.2f} ms"
                                           for c, r in rows.items()) + f"  -> step {args.contexts[1]}/{args.contexts[0]} = {ratio:.2f}x")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
