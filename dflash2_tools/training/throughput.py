"""Training throughput of the recipe's levers, side by side: block positions per second.

    python -m dflash2_tools.training.throughput --data data/smollm2-sharegpt-turns-128 --steps 8 \
        --out docs/training/throughput.json

Each setting runs the same batches (same seed, steps, anchors) from the same drafter; the time of
a step is features + drafter forward/backward + optimiser, and the median over steps 2..N is
reported (step 1 warms up). Stored settings read a feature store filled beforehand (its one-off
fill is timed and reported separately: it costs one target forward per sequence, like an online
epoch).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

from ..target import load_target
from .batches import batch_indices, collate
from .data import load_split
from .features import FeatureStore, features_for_batch, store_key
from .forward import LossHead, compute_loss
from .loop import parse_args
from .model import make_drafter

SETTINGS = {  # name -> (loss vocabulary, feature source, distillation weight)
    "old recipe (full-vocab CE, online features)": ("full", "online", 0.0),
    "draft-vocab CE, online features": ("draft", "online", 0.0),
    "full-vocab CE, stored features": ("full", "disk", 0.0),
    "draft-vocab CE, stored features": ("draft", "disk", 0.0),
    "draft-vocab CE, stored features + teacher (distillation)": ("draft", "disk", 1.0),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", nargs="+", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--blocks-per-seq", type=int, default=24)
    ap.add_argument("--init-from", default=".", help="drafter whose architecture and draft vocabulary are timed")
    ap.add_argument("--feature-cache-dir", default="/tmp/dflash2-throughput-features")
    ap.add_argument("--out", default=None)
    cli = ap.parse_args(argv)
    torch.manual_seed(0)
    target, tokenizer = load_target(None, dtype=torch.float32)
    target.requires_grad_(False)
    base = ["--data", *cli.data, "--out", "/tmp/unused", "--init-from", cli.init_from, "--max-response-tokens", "128",
            "--batch-size", str(cli.batch_size), "--blocks-per-seq", str(cli.blocks_per_seq), "--precision", "fp32"]
    args = parse_args(base)
    args.checkpoint = Path("/nonexistent")
    args.pad_id = tokenizer.pad_token_id or 0
    train, _ = load_split(args.data, args.max_len, args.max_response_tokens)
    steps = [batch_indices([len(t) for t, _ in train], args.batch_size, s, 0, bucket=64) for s in range(cli.steps)]
    used = sorted({i for idx in steps for i in idx})
    subset = [train[i] for i in used]
    remap = {i: n for n, i in enumerate(used)}
    steps = [[remap[i] for i in idx] for idx in steps]
    results = {"steps": cli.steps, "batch_size": args.batch_size, "blocks_per_seq": args.blocks_per_seq,
               "threads": torch.get_num_threads(), "settings": {}}
    for name, (vocab, source, distill) in SETTINGS.items():
        drafter, _, _, _ = make_drafter(target, args, subset)
        head = LossHead.of(drafter, target, vocab)
        opt = torch.optim.AdamW(drafter.parameters(), lr=1e-5)
        teacher_k = args.teacher_k if distill else 0
        args.distill_weight = distill
        store = None
        fill_s = None
        if source == "disk":
            cfg = drafter.config
            key = store_key("throughput", cfg.target_layer_ids, None, False, teacher_k, cfg.draft_vocab_ids if vocab == "draft" else None, subset)
            store = FeatureStore(Path(cli.feature_cache_dir) / key, [len(t) for t, _ in subset], len(cfg.target_layer_ids) * cfg.hidden_size, teacher_k)
            t0 = time.time()
            for idx in steps:
                features_for_batch(store, idx, subset, target, cfg, "cpu", contextlib.nullcontext, args.pad_id, head, teacher_k)
            fill_s = time.time() - t0
        times, positions = [], []
        for s, idx in enumerate(steps):
            tokens, lengths, prompt_lengths = collate([subset[i] for i in idx], args.pad_id)
            t0 = time.time()
            features, teacher = features_for_batch(store, idx, subset, target, drafter.config, "cpu", contextlib.nullcontext, args.pad_id, head, teacher_k)
            loss, _ = compute_loss(drafter, target, head, (tokens, lengths, prompt_lengths), features, torch.Generator().manual_seed(s), args, teacher)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.time() - t0)
            positions.append(int(torch.clamp(lengths - prompt_lengths, max=args.blocks_per_seq).sum()) * (drafter.config.block_size - 1))
        med = statistics.median(times[1:])
        rate = sum(positions[1:]) / sum(times[1:])  # steps 2..N
        results["settings"][name] = {"median_step_s": med, "block_positions_per_s": rate, "fill_s": fill_s}
        print(f"{name:60s} {med:6.2f} s/step  {rate:6.0f} block positions/s" + (f"  (store filled in {fill_s:.1f} s)" if fill_s else ""), flush=True)
    if cli.out:
        Path(cli.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cli.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
