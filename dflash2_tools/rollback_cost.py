"""What rolling back a stateful target costs per decoding step, on tiny random targets.

Side by side in one process: the tiny GLM-5.3-Flash-architecture hybrid (KDA linear attention +
MLA/DSA) and the same architecture with every layer MLA/DSA (attention-only, similar size), each
driven by the same kind of random drafter through ``target.generate(assistant_model=drafter)``.
A random drafter is rejected at almost every step, so almost every step rolls back.

Reported per decoding step (medians over prompts, after a warm-up run): wall time, the rollback
share (snapshot + replay), and what the fallback -- a second target forward over the accepted
tokens -- would have cost instead.

    python -m dflash2_tools.rollback_cost --out docs/rollback_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from . import drafter as root
from .tiny_targets import tiny_glm5_next


def _drafter(target, seed=1):
    tcfg = target.config.get_text_config()
    cfg = root.config_class()(
        vocab_size=tcfg.vocab_size, hidden_size=tcfg.hidden_size, intermediate_size=56, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_target_layers=tcfg.num_hidden_layers,
        target_layer_ids=[0, tcfg.num_hidden_layers - 1], target_hidden_reduction="mean", mask_token_id=tcfg.vocab_size - 2,
        block_size=8, conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=5,
    )
    torch.manual_seed(seed)
    return root.model_class()._from_config(cfg).eval()


@torch.no_grad()
def _second_forward_seconds(target, prompt, n_tokens: int, reps: int = 5) -> float:
    """Median time of the fallback: one target forward over ``n_tokens`` accepted tokens after the prompt."""
    from transformers import DynamicCache

    times = []
    for _ in range(reps):
        cache = DynamicCache(config=target.config)
        target(prompt, past_key_values=cache, use_cache=True)
        t0 = time.perf_counter()
        target(prompt[:, -n_tokens:], past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(kind: str, prompts, max_new_tokens: int) -> dict:
    layer_types = None if kind == "hybrid" else ["full_attention"] * 5
    target = tiny_glm5_next(layer_types=layer_types)
    drafter = _drafter(target)
    gen = root.generation()
    gen.dflash2_generate(target, drafter, prompts[0], max_new_tokens=8, do_sample=False)  # warm-up
    per_step, rollback_per_step, accept = [], [], []
    for ids in prompts:
        want = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        out, stats = gen.dflash2_generate(target, drafter, ids, max_new_tokens=max_new_tokens, do_sample=False)
        if not torch.equal(out, want):
            raise AssertionError(f"{kind}: speculative output differs from the target's own greedy output")
        steps = max(len(stats.accept_lengths), 1)
        per_step.append(stats.seconds / steps)
        rollback_per_step.append(stats.rollback_seconds / steps)
        accept.append(stats.mean_acceptance_length)
    return {
        "target": f"tiny glm5_next, {kind}",
        "params": sum(p.numel() for p in target.model.language_model.parameters()),
        "linear_attention_layers": sum(t == "linear_attention" for t in target.config.get_text_config().layer_types),
        "step_seconds_median": statistics.median(per_step),
        "rollback_seconds_per_step_median": statistics.median(rollback_per_step),
        "mean_acceptance_length": statistics.mean(accept),
        "fallback_second_forward_seconds": _second_forward_seconds(target, prompts[0], 1),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 100, (1, int(n)), generator=g) for n in torch.randint(8, 40, (args.prompts,), generator=g)]
    rows = [measure(kind, prompts, args.max_new_tokens) for kind in ("hybrid", "attention-only")]
    hybrid, attn = rows
    summary = {
        "rows": rows,
        "extra_step_seconds_vs_attention_only": hybrid["step_seconds_median"] - attn["step_seconds_median"],
        "rollback_share_of_hybrid_step": hybrid["rollback_seconds_per_step_median"] / hybrid["step_seconds_median"],
        "rollback_vs_fallback_forward": hybrid["rollback_seconds_per_step_median"] / hybrid["fallback_second_forward_seconds"],
        "threads": args.threads,
        "max_new_tokens": args.max_new_tokens,
        "prompts": args.prompts,
    }
    print("| target | params | linear layers | step (ms, median) | rollback per step (ms) | fallback 2nd forward (ms) | tau |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['target']} | {r['params'] / 1e3:.0f}K | {r['linear_attention_layers']} | {1e3 * r['step_seconds_median']:.1f} | "
              f"{1e3 * r['rollback_seconds_per_step_median']:.1f} | {1e3 * r['fallback_second_forward_seconds']:.1f} | "
              f"{r['mean_acceptance_length']:.2f} |")
    print(f"rollback share of a hybrid step: {100 * summary['rollback_share_of_hybrid_step']:.1f}%; "
          f"rollback / fallback forward: {summary['rollback_vs_fallback_forward']:.2f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
