"""What a tree verification costs on this machine: one target forward over N tree nodes vs one token.

    python -m dflash2_tools.tree_cost --sizes 1 2 4 8 16 24 32 48 64 --out docs/tree/cost_fp32_avx2.json

The embedded target, a committed context of ``--context`` tokens in its cache, then ONE forward
over N nodes of a random tree under the tree mask (each node sees the context and its
ancestors, positions by depth), exactly the call tree verification makes; and, beside it, N
tokens in a chain (causal mask), what linear verification of N drafts costs. Median of
``--repeats`` after a warm-up, as a multiple of the one-token forward. Writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import json
import sys
import statistics
import time
from pathlib import Path

import torch

from . import drafter as root
from .precision import bf16_is_fast
from .target import load_target


def random_tree(tree_module, n_nodes: int, vocab: int, generator) -> object:
    """A tree of n_nodes + 1 nodes whose shape resembles best-first trees: most nodes on a few deep paths."""
    tree = tree_module.root_tree(1)
    while len(tree) < n_nodes + 1:
        parent = int(torch.randint(max(len(tree) - 3, 0), len(tree), (), generator=generator))  # near the newest nodes
        tree.add(int(torch.randint(2, vocab, (), generator=generator)), parent)
    return tree


@torch.no_grad()
def time_forward(target, cache_len: int, make_inputs, repeats: int) -> float:
    from transformers.cache_utils import DynamicCache

    context = torch.randint(2, 1000, (1, cache_len))
    cache = DynamicCache()
    target(input_ids=context, past_key_values=cache, use_cache=True, logits_to_keep=1)
    times = []
    for _ in range(repeats + 1):
        kwargs = make_inputs()
        t0 = time.perf_counter()
        target(past_key_values=cache, use_cache=True, **kwargs)
        times.append(time.perf_counter() - t0)
        if cache.get_seq_length() > cache_len:
            cache.crop(cache_len - cache.get_seq_length())  # back to the context (crop takes a negative count)
    return statistics.median(times[1:])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", type=int, default=[1, 2, 4, 8, 16, 24, 32, 48, 64])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    ap.add_argument("--out", default="docs/tree/cost.json")
    args = ap.parse_args(argv)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(args.dtype) or (torch.bfloat16 if bf16_is_fast("cpu") else torch.float32)
    target, _ = load_target(None, dtype=dtype)
    tree_module = root.tree()
    g = torch.Generator().manual_seed(0)
    base = time_forward(target, args.context, lambda: {"input_ids": torch.tensor([[5]])}, args.repeats)
    rows = []
    for n in args.sizes:
        tree = random_tree(tree_module, max(n - 1, 0), 1000, g)  # n nodes including the root
        mask = tree_module.tree_attention_mask(tree, torch.ones(args.context, dtype=torch.long), dtype)
        positions = (args.context + torch.tensor(tree.depths))[None]
        tree_s = time_forward(target, args.context, lambda: {"input_ids": torch.tensor([tree.tokens]), "position_ids": positions,
                                                               "attention_mask": mask}, args.repeats)
        chain_s = time_forward(target, args.context, lambda: {"input_ids": torch.randint(2, 1000, (1, n))}, args.repeats)
        rows.append({"nodes": n, "tree_ms": 1e3 * tree_s, "chain_ms": 1e3 * chain_s, "tree_x": tree_s / base, "chain_x": chain_s / base,
                     "depth": max(tree.depths)})
        print(f"{n:3d} nodes: tree {1e3 * tree_s:6.1f} ms ({tree_s / base:4.2f}x one token), chain {1e3 * chain_s:6.1f} ms ({chain_s / base:4.2f}x)", flush=True)
    result = {"dtype": str(dtype).replace("torch.", ""), "context": args.context, "one_token_ms": 1e3 * base, "threads": torch.get_num_threads(),
              "rows": rows, "command": "python -m dflash2_tools.tree_cost " + " ".join(sys.argv[1:] if argv is None else argv)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))


def plot(result, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    xs = [r["nodes"] for r in result["rows"]]
    ax.plot(xs, [r["tree_x"] for r in result["rows"]], "o-", label="tree (tree mask)")
    ax.plot(xs, [r["chain_x"] for r in result["rows"]], "s--", label="chain (causal)")
    ax.set_xlabel("tokens verified in one target forward")
    ax.set_ylabel("time / one-token forward")
    ax.set_title(f"Verification cost, SmolLM2-135M {result['dtype']}, {result['context']}-token context")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
