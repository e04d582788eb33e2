"""Which engine writes training responses fastest on THIS machine, and does it write the target's text?

    python -m dflash2_tools.engine_speed --batch-sizes 16 64 --dtypes float32 bfloat16
    python -m dflash2_tools.engine_speed --llamacpp --batch-sizes 1 16 48   # llama.cpp's batched decoding too

For each (dtype, batch size): batched greedy ``model.generate`` over the same ShareGPT
all-turns prompts (the data engine's own prompts and trimming), new tokens per second, and
how often each response equals the fp32 batch-1 reference token for token (with the mean
position of the first divergence where it does not). Batched left-padded fp32 is not bit
identical to batch 1 (other GEMM shapes), so agreement is measured, not assumed.

With ``--llamacpp`` (built by ``python -m dflash2_tools.llamacpp build``): llama.cpp decoding the
same Q4_1 GGUF, throughput of ``--batch-sizes`` parallel sequences from ``llama-batched-bench``
(prompt of the prompts' mean length, the same new tokens), and agreement from ``llama-simple``'s
greedy text on the same prompts, re-tokenised and compared with the fp32 transformers reference.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
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


def llamacpp_rows(tokenizer, prompts, reference, batch_sizes, max_new_tokens, threads) -> list[dict]:
    """llama.cpp rows: batched decoding throughput and greedy agreement with ``reference``."""
    from .llamacpp import llamacpp_dir
    from .target import smollm2_gguf_path

    bin_dir = llamacpp_dir() / "build" / "bin"
    if not (bin_dir / "llama-batched-bench").exists() or not (bin_dir / "llama-simple").exists():
        raise SystemExit(f"--llamacpp needs llama-batched-bench and llama-simple in {bin_dir}: python -m dflash2_tools.llamacpp build")
    n_prompt = round(sum(len(p) for p in prompts) / len(prompts))
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", str(smollm2_gguf_path()), "-c", str((n_prompt + max_new_tokens) * max(batch_sizes) + 64),
           "-npp", str(n_prompt), "-ntg", str(max_new_tokens), "-npl", ",".join(map(str, batch_sizes)), "-t", str(threads)]
    table = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    speed = {}
    for line in table.splitlines():  # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[2].isdigit():
            speed[int(cells[2])] = float(cells[7])
    divergence = []
    for prompt, ref in zip(prompts, reference):
        text = tokenizer.decode(prompt)
        done = subprocess.run([str(bin_dir / "llama-simple"), "-m", str(smollm2_gguf_path()), "-n", str(max_new_tokens), text],
                              capture_output=True, text=True, check=True)
        answer = re.split(r"<\|im_start\|>assistant\n", done.stdout)[-1]  # stdout echoes the prompt, then the answer
        theirs = tokenizer(answer, add_special_tokens=False)["input_ids"]
        divergence.append(first_divergence(theirs[: len(ref)], ref))
    diverged = [d for d in divergence if d is not None]
    return [{"engine": "llama.cpp (Q4_1 GGUF, batched-bench)", "batch_size": b, "new_tokens_per_s": speed.get(b),
             "equal_to_fp32_batch1": (len(divergence) - len(diverged)) / len(divergence),
             "mean_first_divergence": sum(diverged) / len(diverged) if diverged else None,
             "first_divergence_per_prompt": divergence} for b in batch_sizes]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=EMBEDDED_TARGET)
    ap.add_argument("--prompts", type=int, default=16, help="prompts timed per setting (and checked against batch 1)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--dtypes", nargs="+", default=["float32"], choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--llamacpp", action="store_true", help="also measure llama.cpp's batched decoding of the GGUF")
    ap.add_argument("--skip-transformers", action="store_true", help="only the fp32 batch-1 reference, then llama.cpp")
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
        for batch_size in [] if args.skip_transformers else args.batch_sizes:
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
    if args.llamacpp:
        for row in llamacpp_rows(tokenizer, prompts, reference, args.batch_sizes, args.max_new_tokens, torch.get_num_threads()):
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
