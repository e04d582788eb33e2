"""The main job: stream speculative generation with the embedded target and the shipped drafter.

    python -m dflash2_tools.demo "Explain speculative decoding in two sentences."

The text is streamed through the plain transformers call
``target.generate(**inputs, assistant_model=drafter, streamer=...)``; then the target alone
generates the same prompt, and the run ends with tokens/s of both, the speedup and the mean
acceptance length, all measured in this process (after a warm-up).
"""

from __future__ import annotations

import argparse
import time

import torch

from . import drafter as root
from .precision import resolve_dtype
from .target import EMBEDDED_TARGET, load_target

DEFAULT_PROMPT = "Write a short Python function that checks whether a string is a palindrome, and explain it."


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    ap.add_argument("--target", default=EMBEDDED_TARGET)
    ap.add_argument("--drafter", default=str(root.REPO_ROOT), help="drafter folder or Hub id (default: the shipped one)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="auto: bfloat16 on GPUs and CPUs with AVX-512 bf16 / AMX, else float32 (see precision.py)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draft-tokens", type=int, default=None,
                    help="verify only the first N drafted tokens per step (num_assistant_tokens; default: the whole block)")
    args = ap.parse_args(argv)

    from transformers import TextStreamer

    dtype = resolve_dtype(args.dtype)
    args.dtype = str(dtype).removeprefix("torch.")
    target, tokenizer = load_target(args.target, dtype=dtype)
    if not (root.Path(args.drafter) / "model.safetensors").is_file() and root.Path(args.drafter).exists():
        raise SystemExit(f"no drafter weights in {args.drafter}: train one (python -m dflash2_tools.train) and export it")
    drafter = root.load_drafter(args.drafter, dtype=dtype).eval()
    gen = root.generation_of(drafter)

    messages = [{"role": "user", "content": args.prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    kw = dict(do_sample=False, max_new_tokens=args.max_new_tokens)
    spec_kw = {} if args.draft_tokens is None else {"num_assistant_tokens": args.draft_tokens}
    target.generate(**inputs, do_sample=False, max_new_tokens=8)  # warm-up
    target.generate(**inputs, assistant_model=drafter, do_sample=False, max_new_tokens=8, **spec_kw)

    print(f"\n>>> {args.prompt}\n")
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    with gen.collect_stats() as runs:
        t0 = time.perf_counter()
        spec = target.generate(**inputs, assistant_model=drafter, streamer=streamer, **kw, **spec_kw)
        t_spec = time.perf_counter() - t0
    stats = runs[-1]
    t0 = time.perf_counter()
    plain = target.generate(**inputs, **kw)
    t_plain = time.perf_counter() - t0

    n_spec = spec.shape[1] - inputs["input_ids"].shape[1]
    n_plain = plain.shape[1] - inputs["input_ids"].shape[1]
    print("\n" + "-" * 60)
    print(f"target alone : {n_plain / t_plain:6.1f} tok/s ({n_plain} tokens, {t_plain:.2f} s)")
    print(f"DFlash 2     : {n_spec / t_spec:6.1f} tok/s ({n_spec} tokens, {t_spec:.2f} s)")
    print(f"speedup      : {(n_spec / t_spec) / (n_plain / t_plain):.2f}x   mean acceptance length: {stats.mean_acceptance_length:.2f} tokens/target forward")
    for name, c in sorted(stats.per_proposer.items()):  # which proposal the hybrid rule verified, and how it fared
        print(f"  {name:8s}: {c['steps']} steps, {(c['accepted'] + c['steps']) / c['steps']:.2f} tokens/target forward")
    print(exactness_line(target, drafter, inputs, spec, plain, args.dtype, kw, spec_kw))


FP32_CHECK_TOKENS = 64  # tokens of the fp32 exactness check a bf16 run adds (bounded: it is a second pair of generations)


def first_difference(a: torch.Tensor, b: torch.Tensor, start: int) -> int | None:
    """Index (counted from ``start``) of the first token where two [1, n] sequences differ; None if one prefixes the other."""
    for i, (x, y) in enumerate(zip(a[0, start:].tolist(), b[0, start:].tolist())):
        if x != y:
            return i
    return None if a.shape[1] == b.shape[1] else min(a.shape[1], b.shape[1]) - start


def exactness_line(target, drafter, inputs, spec, plain, dtype: str, kw: dict, spec_kw: dict) -> str:
    """One line saying what holds: fp32 output is exactly the target's; a bf16 run reports where its text parts from
    the target's and why, then checks exactness in fp32 on the same prompt."""
    n_prompt = inputs["input_ids"].shape[1]
    if dtype == "float32":
        return f"same output as the target alone (fp32, exact): {'yes' if torch.equal(spec, plain) else 'NO -- please report this'}"
    part = first_difference(spec, plain, n_prompt)
    bf16 = ("identical in bf16" if part is None else
            f"in bf16 the texts part at token {part} ({spec.shape[1] - n_prompt} vs {plain.shape[1] - n_prompt} tokens): a bf16 "
            "multi-token verification rounds differently from one-token decoding, so any verifier drifts")
    check_kw = {**kw, "max_new_tokens": min(kw["max_new_tokens"], FP32_CHECK_TOKENS)}
    target32, drafter32 = target.float(), drafter.float()
    same32 = torch.equal(target32.generate(**inputs, assistant_model=drafter32, **check_kw, **spec_kw), target32.generate(**inputs, **check_kw))
    target.to(torch.bfloat16), drafter.to(torch.bfloat16)
    return f"same output as the target alone: {bf16}; in fp32 (exact): {'yes' if same32 else 'NO -- please report this'} ({check_kw['max_new_tokens']} tokens)"


if __name__ == "__main__":
    main()
