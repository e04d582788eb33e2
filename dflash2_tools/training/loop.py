"""Stage 7, loop: train a DFlash 2 drafter for any causal-LM target, on CPU or N GPUs, resumably.

    # 2-core CPU, embedded SmolLM2-135M-Instruct target
    python -m dflash2_tools.train --data data/smollm2-sharegpt --out runs/smollm2 --mask-token-id 16
    # N processes, any target (same script): N GPUs, or N gloo processes on a CPU-only machine (training/ranks.py)
    accelerate launch --multi_gpu --num_processes N -m dflash2_tools.train --target zai-org/GLM-5.3-Flash --data DATA --out OUT --bf16

Each step:  features (and teacher) of the batch's sequences <- the feature store, or the frozen
target for sequences not stored yet;  ``--blocks-per-seq`` random-anchor blocks per sequence
drafted in ONE drafter forward;  loss = block CE over the draft vocabulary + distillation +
selector term, position- or acceptance-weighted;  AdamW step.

Everything needed to continue is in ``OUT/checkpoint`` (weights, optimizer, schedule, step,
budget spent); the data order and anchors are a pure function of (seed, step), so a resumed run
takes exactly the batches an uninterrupted one would, with any number of processes holding the
same global batch (``--batch-size`` is per process). Re-running the same command resumes.
With ``--budget-cpu-minutes`` the cosine schedule runs over the process's CPU time spent training
instead of steps (evaluation excluded): ablations then compare recipes at the same compute, even
when other work shares the machine.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..precision import bf16_is_fast
from ..target import EMBEDDED_TARGET, cache_dir, load_target, resolve_target
from .batches import batch_indices, collate
from .data import load_split
from .evaluate import evaluate
from .features import FeatureStore, features_for_batch, sequence_digests, store_key, store_settings
from .forward import LossHead, compute_loss
from .model import make_drafter
from .ranks import Ranks, sequence_generators


def lr_at(progress: float, base: float, warmup: float) -> float:
    """Linear warm-up over the first ``warmup`` of training, then cosine to 0; ``progress`` in [0, 1]."""
    if progress < warmup:
        return base * max(progress / warmup, 1e-3)
    return base * 0.5 * (1 + math.cos(math.pi * min((progress - warmup) / max(1 - warmup, 1e-8), 1.0)))


def save_checkpoint(path: Path, drafter, optimizer, state: dict, accelerator=None):
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model = accelerator.unwrap_model(drafter) if accelerator else drafter
    model.save_pretrained(tmp)
    torch.save({"optimizer": optimizer.state_dict(), **state}, tmp / "trainer_state.pt")
    if path.exists():
        old = path.with_name(path.name + ".old")
        path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old)
    else:
        tmp.rename(path)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=EMBEDDED_TARGET)
    ap.add_argument("--target-name", default=None, help="name recorded in the drafter config (default: --target)")
    ap.add_argument("--data", required=True, nargs="+", help="folder(s) written by dflash2_tools.regenerate, read in the order given")
    ap.add_argument("--train-limit", type=int, default=None, help="train on the first N training sequences only (dev unchanged)")
    ap.add_argument("--out", required=True)
    a = ap.add_argument_group("drafter (a fresh one; --init-from and resuming keep the saved architecture)")
    a.add_argument("--init-from", default=None, help="start from this drafter's weights (architecture options are then ignored)")
    a.add_argument("--init-from-target", action="store_true",
                   help="fresh drafter: its layers start as the target's last layers, fc passes the deepest tapped layer")
    a.add_argument("--block-size", type=int, default=8)
    a.add_argument("--layers", type=int, default=3)
    a.add_argument("--num-context-layers", type=int, default=4, help="target layers tapped (spread over the target)")
    a.add_argument("--target-layer-ids", type=int, nargs="*", default=None)
    a.add_argument("--intermediate-size", type=int, default=None)
    a.add_argument("--heads", type=int, default=None)
    a.add_argument("--kv-heads", type=int, default=None)
    a.add_argument("--sliding-window", type=int, default=None)
    a.add_argument("--mask-token-id", type=int, default=None)
    a.add_argument("--conv-group-size", type=int, default=16)
    a.add_argument("--selector-rank", type=int, default=64)
    a.add_argument("--selector-top-k", type=int, default=16)
    a.add_argument("--no-conv", action="store_true", help="plain DFlash layers (ablation)")
    a.add_argument("--no-selector", action="store_true", help="no candidate selector (ablation)")
    a.add_argument("--draft-vocab", type=int, default=8192,
                   help="fresh drafter: draft vocabulary = the N most frequent training response ids (0: full vocabulary)")
    o = ap.add_argument_group("objective")
    o.add_argument("--loss-vocab", choices=["draft", "full"], default="draft",
                   help="CE over the draft vocabulary's rows (what the drafter drafts from) or the full head (the old recipe)")
    o.add_argument("--selector-weight", type=float, default=1.0)
    o.add_argument("--distill-weight", type=float, default=0.0, help="weight of the distillation term (teacher top-k; 0: off)")
    o.add_argument("--teacher-k", type=int, default=8, help="teacher log-probs kept per token (by a feature store always; online "
                   "only with --distill-weight > 0)")
    o.add_argument("--position-weighting", choices=["decay", "chain"], default="decay",
                   help="decay: w_k = exp(-(k-1)/gamma); chain: also times the drafter's detached chance of reaching k")
    o.add_argument("--chain-floor", type=float, default=0.1)
    o.add_argument("--gamma", type=float, default=None, help="position-decay of the loss weights (default: 4 for B=8, 7 for B=16)")
    d = ap.add_argument_group("data and batches")
    d.add_argument("--max-len", type=int, default=768)
    d.add_argument("--max-response-tokens", type=int, default=None,
                   help="train (and evaluate) on the first N response tokens only (long greedy responses of a small target "
                   "end in loops; see dflash2_tools.data_stats)")
    d.add_argument("--batch-size", type=int, default=4)
    d.add_argument("--blocks-per-seq", type=int, default=24,
                   help="random-anchor blocks per sequence per step (the target forward is paid once per sequence)")
    d.add_argument("--length-bucket", type=int, default=64, help="batch sequences of similar length (0: plain random batches)")
    d.add_argument("--feature-cache", choices=["disk", "online"], default="disk",
                   help="disk: features (+ teacher) stored under --feature-cache-dir the first time a sequence is seen and "
                   "memory-mapped ever after (later epochs and runs skip the target); online: a target forward every step")
    d.add_argument("--feature-cache-dir", default=None, help="default: ~/.cache/dflash2/features ($DFLASH2_CACHE/features)")
    d.add_argument("--fill-features-only", action="store_true", help="fill the feature store for every training sequence, then exit")
    t = ap.add_argument_group("schedule")
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--warmup", type=float, default=0.04)
    t.add_argument("--clip", type=float, default=1.0)
    t.add_argument("--max-steps", type=int, default=4000, help="total steps of the cosine schedule")
    t.add_argument("--budget-cpu-minutes", type=float, default=None,
                   help="train for this many CPU-minutes of this process (all its threads; evaluation excluded); the "
                   "schedule follows CPU time, so recipes compare at equal compute")
    t.add_argument("--stop-after", type=int, default=None, help="stop (resumably) after this step")
    t.add_argument("--eval-every", type=int, default=200)
    t.add_argument("--eval-sequences", type=int, default=48)
    t.add_argument("--save-every", type=int, default=50)
    t.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                   help="bf16 autocast or fp32; auto: bf16 on GPUs and CPUs with AVX-512 bf16 / AMX only (on an AVX2 CPU "
                   "a bf16 step measured ~27x slower, see precision.py)")
    t.add_argument("--bf16", dest="precision", action="store_const", const="bf16", help="same as --precision bf16")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--eval-only", action="store_true",
                   help="evaluate the drafter (OUT's checkpoint, else --init-from) on the dev split, print the JSON record, exit")
    t.add_argument("--eval-block-size", type=int, default=None,
                   help="with --eval-only: draft and verify blocks of this size (e.g. a drafter trained at 16 verified at 8)")
    t.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.mask_token_id is None and not args.init_from:
        ap.error("--mask-token-id is required for a fresh drafter: an id of the target's vocabulary that never occurs in text")
    return args


def main(argv=None):
    from accelerate import Accelerator

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    device, is_main, ranks = accelerator.device, accelerator.is_main_process, Ranks(accelerator.num_processes, accelerator.device)
    out = Path(args.out)
    args.checkpoint = out / "checkpoint"
    log_path = out / "log.jsonl"
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    target, tokenizer = load_target(args.target, dtype=torch.float32)
    target.to(device).requires_grad_(False)
    args.target_name = args.target_name or (
        "HuggingFaceTB/SmolLM2-135M-Instruct" if args.target in (EMBEDDED_TARGET, "embedded") else resolve_target(args.target)
    )
    args.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    train, dev = load_split(args.data, args.max_len, args.max_response_tokens)
    drafter, state, step, tokens_seen = make_drafter(target, args, train)  # a fresh draft vocabulary counts ALL training data
    train = train[: args.train_limit] if args.train_limit else train
    drafter.to(device).train()
    cfg = drafter.config
    n_params = sum(p.numel() for p in drafter.parameters())
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
    ranks.broadcast_parameters(drafter)  # gradients are summed by ranks.sum_gradients, not DDP (training/ranks.py)
    optimizer = accelerator.prepare(optimizer)
    raw = drafter
    loss_head = LossHead.of(raw, target, args.loss_vocab)
    eval_head = LossHead.of(raw, target, "draft")  # what generation drafts from
    use_bf16 = args.precision == "bf16" or (args.precision == "auto" and bf16_is_fast(device.type))

    def autocast():
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_bf16)

    if is_main:
        print(f"drafter: {n_params / 1e6:.2f}M params, {cfg.num_hidden_layers} layers, block {cfg.block_size}, target layers "
              f"{cfg.target_layer_ids}, draft vocabulary {len(cfg.draft_vocab_ids) if cfg.draft_vocab_ids else 'full'}; "
              f"{'bf16 autocast' if use_bf16 else 'fp32'}; data: {len(train)} train / {len(dev)} dev sequences; "
              + (f"resuming at step {step}" if step else "starting"), flush=True)
    if args.eval_block_size is not None:
        if not args.eval_only:
            raise SystemExit("--eval-block-size applies to --eval-only (a run trains and evaluates at its own block size)")
        if not 2 <= args.eval_block_size <= cfg.block_size:
            raise SystemExit(f"--eval-block-size {args.eval_block_size}: use 2..{cfg.block_size} (the drafter's trained block size)")
        raw.config.block_size = args.eval_block_size  # the block is [anchor, mask x (B-1)]: a shorter one is a smaller input
    if is_main and (args.eval_only or (step == 0 and args.init_from and not log_path.exists())):
        # a warm start logs where it starts, on ITS dev split, so its learning curve has a baseline
        record = {"step": step, "tokens_seen": tokens_seen, "loss": None, "dev": evaluate(raw, target, eval_head, dev, args, device, autocast)}
        if args.eval_only:
            print(json.dumps(record), flush=True)
        else:
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")
    if args.eval_only:
        return

    teacher_k = args.teacher_k if args.distill_weight > 0 else 0  # online: a teacher only when distilling
    store = None
    if args.feature_cache == "disk":
        settings = (args.target_name, cfg.target_layer_ids, cfg.target_hidden_reduction, use_bf16, args.teacher_k,
                    cfg.draft_vocab_ids if args.loss_vocab == "draft" else None)
        key = store_key(*settings, train)
        root_dir = Path(args.feature_cache_dir) if args.feature_cache_dir else cache_dir() / "features"
        width = len(cfg.target_layer_ids) * cfg.hidden_size
        with accelerator.main_process_first():  # the main process creates the arrays and copies known rows; then the others open them
            store = FeatureStore(root_dir / f"features-{key}", [len(t) for t, _ in train], width, args.teacher_k,
                                 store_settings(*settings), sequence_digests(train))
            if is_main:
                copied = store.seed_from_siblings() if store.fraction_filled < 1 else 0
                print(f"feature store {store.folder}: {store.fraction_filled:.0%} of {len(train)} sequences filled "
                      f"({copied} copied from other stores of the same target and settings)", flush=True)

    def batch_features(idx):
        return features_for_batch(store, idx, train, target, cfg, device, autocast, args.pad_id, loss_head, teacher_k)

    if args.fill_features_only:
        if store is None:
            raise SystemExit("--fill-features-only needs --feature-cache disk")
        order = sorted(store.missing(range(len(train))), key=lambda i: len(train[i][0]))[accelerator.process_index :: ranks.world]
        for start in tqdm(range(0, len(order), args.batch_size * 2), desc="filling feature store", unit="batch", disable=not is_main):
            batch_features(order[start : start + args.batch_size * 2])
            if start % (args.batch_size * 2 * 50) == 0:
                store.flush(write_marks=is_main)
        store.flush(ranks.any, write_marks=is_main)  # every rank's sequences marked filled
        return

    budget_s = args.budget_cpu_minutes * 60 if args.budget_cpu_minutes else None
    spent = state.get("train_cpu_seconds", 0.0) if state else 0.0
    positions = state.get("positions", 0) if state else 0
    stop = min(args.stop_after or args.max_steps, args.max_steps)
    if budget_s is None:
        bar = tqdm(total=stop, initial=step, desc="training", unit="step", disable=not is_main)
    else:  # progress in CPU-seconds of the budget
        bar = tqdm(total=budget_s, initial=min(spent, budget_s), desc="training", disable=not is_main,
                   bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} CPU-s [{elapsed}<{remaining}{postfix}]")
    train_lengths = [len(t) for t, _ in train]

    def progress():
        return spent / budget_s if budget_s else step / args.max_steps

    while (spent < budget_s) if budget_s else (step < stop):
        t0 = time.process_time()
        idx = batch_indices(train_lengths, args.batch_size, step, args.seed, accelerator.process_index, accelerator.num_processes,
                            args.length_bucket)
        tokens, lengths, prompt_lengths = collate([train[i] for i in idx], args.pad_id)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(progress(), args.lr, args.warmup)
        features, teacher = batch_features(idx)
        teacher = teacher if args.distill_weight > 0 else None
        with autocast():
            loss, metrics = compute_loss(drafter, target, loss_head, (tokens.to(device), lengths, prompt_lengths), features,
                                         sequence_generators(args.seed, step, idx), args, teacher, sum_over_ranks=ranks.sum)
        accelerator.backward(loss)
        ranks.sum_gradients(drafter.parameters())
        grad_norm = accelerator.clip_grad_norm_(drafter.parameters(), args.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        # over all ranks, in one all-reduce: CPU time (the schedule follows the ranks' mean), tokens, block positions, loss terms
        names = sorted(metrics)
        local = [time.process_time() - t0, int(lengths.sum()), int(torch.clamp(lengths - prompt_lengths, max=args.blocks_per_seq).sum())
                 * (cfg.block_size - 1), float(loss.detach())] + [metrics[k] for k in names]
        summed = ranks.sum(torch.tensor(local, dtype=torch.float64)).tolist()
        elapsed, tokens_seen, positions = summed[0] / ranks.world, tokens_seen + int(summed[1]), positions + int(summed[2])
        loss = summed[3]  # each rank's terms are shares of the global batch's mean: their sum is that mean
        metrics = {k: v / ranks.world if k == "topk_coverage" else v for k, v in zip(names, summed[4:])}
        spent += elapsed
        bar.update(1 if budget_s is None else min(elapsed, max(bar.total - bar.n, 0)))
        bar.set_postfix(loss=f"{loss:.3f}", ce=f"{metrics['ce']:.3f}")
        done = (spent >= budget_s) if budget_s else (step == stop)
        if is_main and (step % args.eval_every == 0 or done):
            record = {"step": step, "tokens_seen": tokens_seen, "train_cpu_seconds": spent, "block_positions": positions,
                      "loss": loss, **metrics, "grad_norm": float(grad_norm), "lr": optimizer.param_groups[0]["lr"],
                      "dev": evaluate(raw, target, eval_head, dev, args, device, autocast)}
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            dv = record["dev"]
            tqdm.write(f"step {step} ({spent / 60:.1f} CPU-min, {positions / max(spent, 1e-9):.0f} positions per CPU-s): loss {record['loss']:.3f} | "
                       f"dev on-policy acceptance {dv.get('on_policy_acceptance_length_selector', dv['on_policy_acceptance_length_argmax']):.2f}"
                       f" | top1 pos1 {dv['top1_per_position'][0]:.2f} pos{cfg.block_size - 1} {dv['top1_per_position'][-1]:.2f}")
        if step % args.save_every == 0 or done:
            if store is not None:
                store.flush(ranks.any, write_marks=is_main)  # every rank's new rows marked filled
            if is_main:
                save_checkpoint(args.checkpoint, drafter, optimizer,
                                {"step": step, "tokens_seen": tokens_seen, "train_cpu_seconds": spent, "positions": positions}, accelerator)
        accelerator.wait_for_everyone()
    bar.close()
