"""Which engine writes training responses fastest on THIS machine, and does it write the target's text?

    python -m dflash2_tools.engine_speed --batch-sizes 16 64 --dtypes float32 bfloat16

For each (dtype, batch size): batched greedy ``model.generate`` over the same ShareGPT
all-turns prompts (the data engine's own prompts and trimming), new tokens per second, and
how often each response equals the fp32 batch-1 reference token for token (with the mean
position of the first divergence where it does not). Batched left-padded fp32 is not bit
identical to batch 1 (other GEMM shapes), so agreement is measured, not assumed.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from .precision import resolve_dtype
from .prompts import TRAINING_PROMPT_SOURCES, trim_history
from .regenerate import encode_prompt, generate_batch
from .target import EMBEDDED_TARGET, load_target


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, None when equal (length included)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=EMBEDDED_TARGET)
    ap.add_argument("--prompts", type=int, default=16, help="prompts timed per setting (and checked against batch 1)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--dtypes", nargs="+", default=["float32"], choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--out", default=None, help="write the table as JSON here")
    args = ap.parse_args(argv)

    rows = []
    _, tokenizer = load_target(args.target, dtype=torch.float32)
    records = TRAINING_PROMPT_SOURCES["sharegpt-all-turns"]()[: args.prompts * 2]
    encoded = [trim_history(lambda m: encode_prompt(tokenizer, m), r["messages"], args.max_prompt_tokens) for r in records]
    prompts = [e for e in encoded if e is not None][: args.prompts]
    greedy = {"do_sample": False}
    reference = None
    for dtype_name in args.dtypes:
        dtype = resolve_dtype(dtype_name)
        model, _ = load_target(args.target, dtype=dtype)
        if reference is None:  # fp32 batch 1: the transformers target's own greedy text
            ref_model = model if dtype == torch.float32 else load_target(args.target, dtype=torch.float32)[0]
            reference = [generate_batch(ref_model, tokenizer, [p], args.max_new_tokens, greedy)[0] for p in prompts]
        for batch_size in args.batch_sizes:
            batch_prompts = (prompts * ((batch_size + len(prompts) - 1) // len(prompts)))[:batch_size]
            generate_batch(model, tokenizer, batch_prompts[:2], 4, greedy)  # warm-up
            t0 = time.perf_counter()
            responses = generate_batch(model, tokenizer, sorted(batch_prompts, key=len), args.max_new_tokens, greedy)
            seconds = time.perf_counter() - t0
            by_prompt = {tuple(p): r for p, r in zip(sorted(batch_prompts, key=len), responses)}
            div = [first_divergence(by_prompt[tuple(p)], ref) for p, ref in zip(prompts, reference)]
            diverged = [d for d in div if d is not None]
            rows.append({
                "engine": f"transformers generate ({str(dtype).removeprefix('torch.')})",
                "batch_size": batch_size,
                "new_tokens_per_s": sum(len(r) for r in responses) / seconds,
                "equal_to_fp32_batch1": (len(div) - len(diverged)) / len(div),
                "mean_first_divergence": sum(diverged) / len(diverged) if diverged else None,
            })
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
