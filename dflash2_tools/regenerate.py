"""Regenerate training responses with the TARGET itself (SPEC section 2c).

A drafter learns to predict what the target says, so the responses must be the
target's own. Prompts are processed in fixed chunks; each finished chunk is one
``chunk_XXXXX.npz`` file (uint16/int32 token ids, compact), so an interrupted run
resumes at the first missing chunk. ``meta.json`` records the target and the
generation settings; resuming with other settings is refused.

    python -m dflash2_tools.regenerate --out data/smollm2 --limit 4000

More data later, in another folder (e.g. with other settings): ``--offset 4096`` skips the
first 4,096 shuffled prompts, so the two folders hold different prompts and ``train --data``
takes both.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from . import prompt_school_math, prompt_stubs
from .precision import resolve_dtype
from .prompts import TRAINING_PROMPT_SOURCES, trim_history
from .target import EMBEDDED_TARGET, load_target

CHUNK = 64
# what meta.json says of each prompt source (the fixed texts are the earlier folders' own, so those resume); called,
# because the generated sources name what they came from: the stubs their library versions, school-math its list digest
PROMPT_SET_DESCRIPTIONS = {
    "sharegpt-first-turns": lambda: "sharegpt-train (first human turn)",
    "sharegpt-all-turns": lambda: "sharegpt-train (every human turn, history trimmed to the prompt budget)",
    "sharegpt-code-math": lambda: "sharegpt-train turns asking for code or math (prompt_domains.py), evaluation near-duplicates dropped",
    "python-stubs": lambda: prompt_stubs.source_description("python-stubs"),
    "python-stubs-more": lambda: prompt_stubs.source_description("python-stubs-more"),
    "school-math": prompt_school_math.source_description,
}


def prompt_set_description(name: str) -> str:
    return PROMPT_SET_DESCRIPTIONS[name]()


def encode_prompt(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def save_chunk(path: Path, prompts: list[list[int]], responses: list[list[int]]) -> None:
    dtype = np.uint16 if max(max(p + r, default=0) for p, r in zip(prompts, responses)) < 65536 else np.int32
    tmp = path.with_suffix(".tmp.npz")
    np.savez(
        tmp,
        tokens=np.array([t for p, r in zip(prompts, responses) for t in p + r], dtype=dtype),
        prompt_lens=np.array([len(p) for p in prompts], dtype=np.int32),
        response_lens=np.array([len(r) for r in responses], dtype=np.int32),
    )
    tmp.rename(path)


def _chunk_paths(folder: str | Path) -> list[Path]:
    """A folder's chunk files in order; ``FOLDER@N``: its first N chunks only (a run that must see the same
    sequences while the data engine keeps adding chunks, e.g. to reuse a feature store keyed by them)."""
    name, _, limit = str(folder).rpartition("@")
    if not (name and limit.isdigit()):
        name, limit = str(folder), ""
    if not Path(name).is_dir():
        raise SystemExit(f"data folder {name} does not exist: run python -m dflash2_tools.regenerate --out {name} first")
    paths = sorted(p for p in Path(name).glob("chunk_*.npz") if ".tmp" not in p.name)
    return paths[: int(limit)] if limit else paths


def load_chunks(folders: str | Path | list[str | Path]) -> list[tuple[np.ndarray, int]]:
    """All regenerated sequences as (token ids, prompt length) pairs: folders in the order given,
    chunks in order within each (so appending a folder leaves the earlier sequences' indices, and
    with them the dev split, unchanged)."""
    folders = [folders] if isinstance(folders, (str, Path)) else list(folders)
    paths = [path for folder in folders for path in _chunk_paths(folder)]
    out = []
    for path in paths:
        z = np.load(path)
        tokens, pl, rl = z["tokens"].astype(np.int64), z["prompt_lens"], z["response_lens"]
        start = 0
        for p, r in zip(pl, rl):
            out.append((tokens[start : start + p + r], int(p)))
            start += p + r
    return out


@torch.inference_mode()
def generate_batch(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, sampling: dict) -> list[list[int]]:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)  # [b, width], left padded
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    out = model.generate(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, pad_token_id=pad, **sampling
    )
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    responses = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))  # keep the EOS: the drafter must predict it
        responses.append(row[:cut])
    return responses


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=EMBEDDED_TARGET, help="Hub id, local folder, or the embedded SmolLM2 (default)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", default="sharegpt-first-turns", choices=sorted(TRAINING_PROMPT_SOURCES),
                    help="sharegpt-all-turns: every human turn with its history (55.7K prompts; the oldest "
                    "exchanges are dropped to fit --max-prompt-tokens); sharegpt-code-math: turns asking for code or math; "
                    "python-stubs: HumanEval-form function stubs from library source (prompt_stubs.py); python-stubs-more: the same from "
                    "the other libraries the project installs (torch, transformers, ...); school-math: mathematics_dataset "
                    "training-split questions (prompt_school_math.py); default: first turns "
                    "only (the earlier folders)")
    ap.add_argument("--limit", type=int, default=None, help="number of training prompts after --offset (default: all)")
    ap.add_argument("--offset", type=int, default=0,
                    help=f"skip this many shuffled prompts (a multiple of {CHUNK}) to extend data in a new folder")
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="auto: bf16 on GPUs and CPUs with native bf16, else fp32 (the faster one, see precision.py); "
                    "generate in the precision you will serve in, since greedy bf16 and fp32 continuations differ")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.offset % CHUNK or args.offset < 0:
        ap.error(f"--offset must be a non-negative multiple of {CHUNK} (chunk files are numbered globally), got {args.offset}")

    # under `accelerate launch` / torchrun every process takes every WORLD_SIZE-th chunk
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu"
    dtype = resolve_dtype(args.dtype, device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sampling = {"do_sample": False} if args.temperature == 0 else {"do_sample": True, "temperature": args.temperature, "top_k": 0, "top_p": 1.0}
    meta = {
        "target": args.target,
        "prompt_set": prompt_set_description(args.prompts),
        "max_prompt_tokens": args.max_prompt_tokens,
        "max_new_tokens": args.max_new_tokens,
        "dtype": str(dtype).removeprefix("torch."),
        "sampling": sampling,
        "seed": args.seed,
        "chunk": CHUNK,
    }
    meta_path = out / "meta.json"
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        if old != meta:
            raise SystemExit(f"{out} was generated with other settings:\n{old}\nnow:\n{meta}\nUse another --out folder.")
    tmp = meta_path.with_name(f"meta.{rank}.tmp")  # atomic: another process may be reading it
    tmp.write_text(json.dumps(meta, indent=1))
    tmp.replace(meta_path)

    torch.manual_seed(args.seed)
    model, tokenizer = load_target(args.target, dtype=dtype, device=device)
    records = TRAINING_PROMPT_SOURCES[args.prompts]()
    random.Random(args.seed).shuffle(records)
    if args.prompts == "sharegpt-all-turns":
        records.sort(key=lambda r: r.get("turn", 1) == 0)  # stable: first turns last (earlier folders hold them)
    if args.limit:
        records = records[: args.offset + args.limit]
    n_chunks = (len(records) + CHUNK - 1) // CHUNK
    first = args.offset // CHUNK
    done = {p.name for p in out.glob("chunk_*.npz")}
    bar = tqdm(total=len(records) - first * CHUNK, desc="regenerating", unit="prompt", disable=rank != 0)
    n_tokens, t0 = 0, time.time()
    for c in range(first, n_chunks):
        path = out / f"chunk_{c:05d}.npz"
        chunk = records[c * CHUNK : (c + 1) * CHUNK]
        if path.name in done or c % world != rank:
            bar.update(len(chunk))
            continue
        encoded = [trim_history(lambda m: encode_prompt(tokenizer, m), r["messages"], args.max_prompt_tokens) for r in chunk]
        encoded = sorted((e for e in encoded if e is not None), key=len)  # less padding per batch
        prompts, responses = [], []
        for b in range(0, len(encoded), args.batch_size):
            batch = encoded[b : b + args.batch_size]
            torch.manual_seed(args.seed * 1_000_003 + c * 1000 + b)
            resp = generate_batch(model, tokenizer, batch, args.max_new_tokens, sampling)
            prompts += batch
            responses += resp
            n_tokens += sum(len(r) for r in resp)
            bar.set_postfix(resp_tok_s=f"{n_tokens / (time.time() - t0):.0f}")
        if prompts:
            save_chunk(path, prompts, responses)
        bar.update(len(chunk))
    bar.close()


if __name__ == "__main__":
    main()
