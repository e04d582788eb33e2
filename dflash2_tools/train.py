"""Train a DFlash 2 drafter for any causal-LM target, on CPU or N GPUs, resumably.

    # 2-core CPU, embedded SmolLM2-135M-Instruct target
    python -m dflash2_tools.train --data data/smollm2-sharegpt --out runs/smollm2
    # N GPUs, any target (same script)
    accelerate launch -m dflash2_tools.train --target zai-org/GLM-5.3-Flash --data DATA --out OUT --bf16

Each step: the frozen target runs once over a batch of (prompt + regenerated response)
sequences and returns hidden states of ``target_layer_ids`` (context features, computed
online: see ``--help`` of ``--blocks-per-seq`` for the cost trade-off); many random-anchor
blocks per sequence are drafted in ONE drafter forward under the block mask; the loss is
the position-weighted block cross-entropy plus the selector term (``losses.py``).

Everything needed to continue is in ``OUT/checkpoint`` (weights, optimizer, schedule,
step); the data order and anchors are a pure function of (seed, step), so a resumed run
takes exactly the batches an uninterrupted one would. Re-running the same command resumes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from . import drafter as root
from .losses import (
    acceptance_lengths,
    block_cross_entropy,
    block_inputs,
    greedy_verifier_steps,
    position_weights,
    sample_anchors,
    selector_cross_entropy,
)
from .precision import bf16_is_fast
from .regenerate import load_chunks
from .target import EMBEDDED_TARGET, load_target, resolve_target

DEV_EVERY = 50  # every 50th regenerated sequence is held out for the training-time dev evaluation


def build_drafter_config(target, args):
    """Size a drafter for this target: hidden size, vocab and head come from the target."""
    C = root.config_class()
    tcfg = target.config.get_text_config()
    n_target = tcfg.num_hidden_layers
    layer_ids = args.target_layer_ids or root.config_module().default_target_layer_ids(n_target, args.num_context_layers)
    heads = args.heads or tcfg.num_attention_heads
    kv_heads = args.kv_heads or getattr(tcfg, "num_key_value_heads", heads)
    head_dim = getattr(tcfg, "head_dim", None) or tcfg.hidden_size // tcfg.num_attention_heads
    return C(
        vocab_size=tcfg.vocab_size,
        hidden_size=tcfg.hidden_size,
        intermediate_size=args.intermediate_size or tcfg.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=getattr(tcfg, "rms_norm_eps", 1e-6),
        rope_parameters=dict(getattr(tcfg, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}),
        max_position_embeddings=getattr(tcfg, "max_position_embeddings", 32768),
        use_sliding_window=args.sliding_window is not None,
        sliding_window=args.sliding_window,
        num_target_layers=n_target,
        target_layer_ids=layer_ids,
        block_size=args.block_size,
        mask_token_id=args.mask_token_id,
        conv_kernel_size=None if args.no_conv else 2,
        conv_group_size=None if args.no_conv else args.conv_group_size,
        selector_rank=None if args.no_selector else args.selector_rank,
        selector_top_k=None if args.no_selector else args.selector_top_k,
        final_logit_softcapping=getattr(tcfg, "final_logit_softcapping", None),
        target_model_type=target.config.model_type,
        # hyper-connection targets ([b, t, streams, H] hidden states): reduce like the target's own head does
        target_hidden_reduction="mean" if getattr(tcfg, "hc_mult", 1) > 1 else None,
        target_name_or_path=args.target_name,
        bos_token_id=getattr(tcfg, "bos_token_id", None),
        eos_token_id=getattr(tcfg, "eos_token_id", None),
        pad_token_id=getattr(tcfg, "pad_token_id", None),
    )


def is_dev_sequence(index: int) -> bool:
    """Whether regenerated sequence ``index`` (chunk order) is in the held-out dev slice."""
    return index % DEV_EVERY == DEV_EVERY - 1


def split_sequences(sequences, max_len: int, max_response_tokens: int | None = None):
    """(train, dev) lists of (tokens, prompt length), each cut to ``max_len`` tokens and to
    ``max_response_tokens`` response tokens; sequences with fewer than 2 response tokens are dropped."""
    train, dev = [], []
    for i, (tokens, prompt_len) in enumerate(sequences):
        tokens = tokens[: min(max_len, prompt_len + max_response_tokens) if max_response_tokens else max_len]
        if len(tokens) - prompt_len < 2:
            continue
        (dev if is_dev_sequence(i) else train).append((tokens, prompt_len))
    return train, dev


def collate(batch, pad_id: int):
    lengths = torch.tensor([len(t) for t, _ in batch])
    prompt_lengths = torch.tensor([p for _, p in batch])
    tokens = torch.full((len(batch), int(lengths.max())), pad_id, dtype=torch.long)
    for i, (t, _) in enumerate(batch):
        tokens[i, : len(t)] = torch.as_tensor(t, dtype=torch.long)
    return tokens, lengths, prompt_lengths


def batch_indices(lengths, batch_size: int, step: int, seed: int, rank: int = 0, world: int = 1, bucket: int = 64) -> list[int]:
    """Indices of this rank's batch at ``step``, from the sequence ``lengths``.

    Every epoch is a permutation seeded by (seed, epoch), so a resumed run sees exactly the
    batches an uninterrupted one would. With ``bucket`` > 0 the permutation is cut into windows of
    ``bucket`` global batches, each window is sorted by length and the global batches are shuffled:
    sequences of similar length share a batch, so little compute goes to padding (measured on the
    shipped data, 4-sequence batches: padded / real tokens 1.44 in random batches, 1.01 with
    bucket 64), while an epoch still holds each sequence once. ``bucket=0``: plain random batches.
    """
    n_items, per_batch = len(lengths), batch_size * world
    per_epoch = max(n_items // per_batch, 1)
    epoch, within = divmod(step, per_epoch)
    rng = np.random.default_rng([seed, epoch])
    perm = rng.permutation(n_items)
    if bucket <= 0 or n_items < per_batch:
        start = (within * world + rank) * batch_size
        return perm[start : start + batch_size].tolist()
    lengths = np.asarray(lengths)
    window = bucket * per_batch
    perm = np.concatenate([w[np.argsort(lengths[w], kind="stable")] for w in np.split(perm, range(window, n_items, window))])
    batches = perm[: per_epoch * per_batch].reshape(per_epoch, per_batch)  # [global batches, world * batch_size]
    batch = batches[rng.permutation(per_epoch)[within]]
    return batch[rank * batch_size : (rank + 1) * batch_size].tolist()


@torch.no_grad()
def target_features(target, tokens, lengths, layer_ids, reduction=None):
    """[b, T] ids -> [b, T, len(layer_ids)*H] context features (one target forward)."""
    gen = root.generation()
    attention_mask = (torch.arange(tokens.shape[1])[None] < lengths[:, None]).long().to(tokens.device)
    # logits_to_keep=1: the LM head over every position was a third of this forward (measured), and unused
    out = target(input_ids=tokens, attention_mask=attention_mask, output_hidden_states=[l + 1 for l in layer_ids], logits_to_keep=1)
    return gen.context_features(out.hidden_states, layer_ids, tokens.shape[1], reduction)


def feature_cache_key(target_name: str, layer_ids, reduction, bf16: bool, sequences) -> str:
    """Fingerprint of what cached features depend on: target, tapped layers, precision, token ids."""
    h = hashlib.sha256(json.dumps([target_name, list(layer_ids), reduction, bf16]).encode())
    for tokens, _ in sequences:
        h.update(np.asarray(tokens, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


@torch.no_grad()
def cache_features(target, sequences, layer_ids, reduction, batch_size, device, autocast, pad_id, path=None, desc="caching target features"):
    """One target pass over the whole training set; features as bf16 ``[T_i, n*H]`` per sequence.

    Worth it when the data is seen for more than one epoch: each later epoch then costs the
    drafter alone (measured here: target features ~2.4 s and drafter fwd+bwd ~2.0 s of a
    4-sequence step). With ``path`` (a ``.npy`` file) the features are written there once and
    memory-mapped by every later run with the same key, so a new run skips the pass.
    """
    offsets = np.cumsum([0] + [len(t) for t, _ in sequences])
    path = Path(path) if path else None
    if path is not None and path.exists():
        flat = np.load(path, mmap_mode="c")  # [sum T_i, n*H] bf16 bits, paged in on demand
        if flat.shape[0] != offsets[-1]:
            raise SystemExit(f"feature cache {path} has {flat.shape[0]} rows, the data {offsets[-1]}: delete it and rerun")
        return [torch.from_numpy(flat[offsets[i] : offsets[i + 1]]).view(torch.bfloat16) for i in range(len(sequences))]
    out = [None] * len(sequences)
    writer = None
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i][0]))  # similar lengths per batch
    for start in tqdm(range(0, len(order), batch_size), desc=desc, unit="batch"):
        idx = order[start : start + batch_size]
        tokens, lengths, _ = collate([sequences[i] for i in idx], pad_id)
        with autocast():
            feats = target_features(target, tokens.to(device), lengths.to(device), layer_ids, reduction)
        if path is not None and writer is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".partial.npy")
            writer = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint16, shape=(int(offsets[-1]), feats.shape[-1]))
        for row, i in enumerate(idx):
            out[i] = feats[row, : int(lengths[row])].to(torch.bfloat16).cpu()
            if writer is not None:
                writer[offsets[i] : offsets[i + 1]] = out[i].view(torch.uint16).numpy()
    if writer is not None:
        writer.flush()
        del writer
        tmp.rename(path)  # complete files only: an interrupted pass starts over
    return out


def stack_features(cached, idx, width):
    feats = [cached[i] for i in idx]
    out = torch.zeros(len(feats), width, feats[0].shape[-1], dtype=feats[0].dtype)
    for row, f in enumerate(feats):
        out[row, : f.shape[0]] = f
    return out


def drafter_forward(drafter, target, tokens, lengths, prompt_lengths, features, generator, n_blocks):
    """``n_blocks`` random-anchor blocks per sequence, drafted in one forward (``blocks_forward``)."""
    anchors, valid = sample_anchors(lengths, prompt_lengths, n_blocks, generator)
    return blocks_forward(drafter, target, tokens, lengths, anchors, valid, features)


def blocks_forward(drafter, target, tokens, lengths, anchors, valid, features):
    """The blocks at ``anchors`` [b, n] in ONE drafter forward under the multi-block training mask
    (block i sees the features of tokens < anchors[i] and its own block only, as at inference).

    Returns (hidden [b, n, B-1, H], logits [b, n, B-1, V], labels [b, n, B-1], anchor ids [b, n]).
    """
    M = root.modeling()
    cfg = drafter.config
    B = cfg.block_size
    b, n_blocks = anchors.shape
    ids, labels = block_inputs(tokens.cpu(), lengths.cpu(), anchors.cpu(), valid.cpu(), B, cfg.mask_token_id)
    dev = tokens.device
    ids, labels, anchors = ids.to(dev), labels.to(dev), anchors.to(dev)
    T = tokens.shape[1]
    noise = drafter.embed_block(target.get_input_embeddings(), ids)  # [b, n*B, H]
    positions = torch.cat(
        [torch.arange(T, device=dev)[None].expand(b, -1), (anchors[:, :, None] + torch.arange(B, device=dev)).view(b, -1)], dim=1
    )  # [b, T + n*B]
    mask = M.multi_block_training_mask(anchors, B, T, cfg.sliding_window)  # [b, 1, n*B, T + n*B]
    out = drafter(noise_embeds=noise, context_hidden_states=features.to(noise.dtype), position_ids=positions, attention_mask=mask)
    hidden = out.last_hidden_state.view(b, n_blocks, B, -1)[:, :, 1:]  # [b, n, B-1, H]
    logits = drafter.draft_logits(target.get_output_embeddings(), hidden)  # [b, n, B-1, V]
    anchor_ids = ids.view(b, n_blocks, B)[:, :, 0]  # [b, n]
    return hidden, logits, labels, anchor_ids


def compute_loss(drafter, target, batch, features, generator, args):
    tokens, lengths, prompt_lengths = batch
    hidden, logits, labels, anchor_ids = drafter_forward(drafter, target, tokens, lengths, prompt_lengths, features, generator, args.blocks_per_seq)
    weights = position_weights(drafter.config.block_size, args.gamma, device=logits.device)
    loss = block_cross_entropy(logits, labels, weights)
    metrics = {"ce": float(loss.detach())}
    if drafter.candidate_selector is not None and args.selector_weight > 0:
        sel, covered = selector_cross_entropy(drafter.candidate_selector, hidden, logits, anchor_ids, labels, weights)
        loss = loss + args.selector_weight * sel
        metrics.update(selector_ce=float(sel.detach()), topk_coverage=float(covered))
    return loss, metrics


@torch.no_grad()
def evaluate(drafter, target, dev, args, device, autocast):
    """Per-position top-1 / top-K recall and acceptance length (argmax and selector walk) on held-out
    sequences: over blocks at random anchors, and on-policy (``on_policy_acceptance_length_*``: the
    anchors a greedy verifier visits when it re-generates the response, i.e. what the plain
    ``generate(..., assistant_model=drafter)`` call measures when the data is the target's own
    greedy output in the precision it is served in)."""
    drafter.eval()
    B = drafter.config.block_size
    K = drafter.config.selector_top_k or 16
    gen = torch.Generator().manual_seed(12345)
    top1 = torch.zeros(B - 1)
    topk = torch.zeros(B - 1)
    count = torch.zeros(B - 1)
    uniform = {"argmax": [], "selector": []}  # acceptance of blocks at random anchors
    on_policy = {"argmax": [0, 0], "selector": [0, 0]}  # [tokens committed, target forwards]
    for start in range(0, min(len(dev), args.eval_sequences), args.batch_size):
        batch = collate(dev[start : start + args.batch_size], args.pad_id)
        tokens, lengths, prompt_lengths = (x.to(device) for x in batch)
        with autocast():
            feats = target_features(target, tokens, lengths, drafter.config.target_layer_ids, drafter.config.target_hidden_reduction)
            hidden, logits, labels, anchor_ids = drafter_forward(drafter, target, tokens, lengths.cpu(), prompt_lengths.cpu(), feats, gen, args.blocks_per_seq)
        logits = logits.float()
        valid = labels != -100
        top = logits.topk(K, dim=-1).indices  # [b, n, B-1, K]
        top1 += ((top[..., 0] == labels) & valid).sum((0, 1)).float().cpu()
        topk += ((top == labels[..., None]).any(-1) & valid).sum((0, 1)).float().cpu()
        count += valid.sum((0, 1)).float().cpu()
        blocks = valid[..., 0]  # blocks with at least one label
        for method, acc in block_acceptance(drafter, hidden, logits, labels, anchor_ids).items():
            uniform[method].append(acc[blocks].float().cpu())
        for row in range(tokens.shape[0]):  # the anchors a greedy verifier would visit, one sequence at a time
            for method, acc in response_acceptance(drafter, target, tokens[row : row + 1], lengths[row : row + 1].cpu(),
                                                   int(prompt_lengths[row]), feats[row : row + 1], autocast).items():
                steps = greedy_verifier_steps(acc.tolist())
                on_policy[method][0] += sum(steps)
                on_policy[method][1] += len(steps)
    drafter.train()
    result = {
        "top1_per_position": (top1 / count.clamp(min=1)).tolist(),
        "topk_per_position": (topk / count.clamp(min=1)).tolist(),
    }
    for method in uniform:  # argmax always (NaN without dev data), the selector where the drafter has one
        if uniform[method] or method == "argmax":
            result[f"acceptance_length_{method}"] = float(torch.cat(uniform[method]).mean()) if uniform[method] else float("nan")
            committed, forwards = on_policy[method]
            result[f"on_policy_acceptance_length_{method}"] = committed / forwards if forwards else float("nan")
    return result


def block_acceptance(drafter, hidden, logits, labels, anchor_ids) -> dict[str, torch.Tensor]:
    """Acceptance length of every block [b, n] under greedy verification: argmax drafts and, if the
    drafter has a selector, its walk through the top-K."""
    out = {"argmax": acceptance_lengths(logits.argmax(-1), labels)}
    if drafter.candidate_selector is not None:
        b, n = anchor_ids.shape
        walk = drafter.candidate_selector.walk(hidden.float().flatten(0, 1), logits.float().flatten(0, 1), anchor_ids.flatten())
        out["selector"] = acceptance_lengths(walk.tokens.view(b, n, -1), labels)
    return out


@torch.no_grad()
def response_acceptance(drafter, target, tokens, lengths, prompt_len: int, features, autocast, chunk: int = 64):
    """Acceptance length of the block anchored at EVERY response token of one sequence ([1, T]), in
    forwards of ``chunk`` blocks -> {method: [n_response_anchors]}."""
    L = int(lengths[0])
    anchors_all = torch.arange(prompt_len, L - 1)  # the first block is drafted after the prefill's own token
    out = {}
    for start in range(0, len(anchors_all), chunk):
        anchors = anchors_all[start : start + chunk][None]  # [1, n]
        with autocast():
            hidden, logits, labels, anchor_ids = blocks_forward(drafter, target, tokens[:, :L], lengths, anchors,
                                                                torch.ones_like(anchors, dtype=torch.bool), features[:, :L])
        for method, acc in block_acceptance(drafter, hidden, logits.float(), labels, anchor_ids).items():
            out.setdefault(method, []).append(acc[0].cpu())
    return {method: torch.cat(parts) for method, parts in out.items()}


def lr_at(step: int, total: int, base: float, warmup: float) -> float:
    warm = max(int(total * warmup), 1)
    if step < warm:
        return base * (step + 1) / warm
    progress = (step - warm) / max(total - warm, 1)
    return base * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def save_checkpoint(path: Path, drafter, optimizer, step: int, tokens_seen: int, accelerator=None):
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model = accelerator.unwrap_model(drafter) if accelerator else drafter
    model.save_pretrained(tmp)
    torch.save({"optimizer": optimizer.state_dict(), "step": step, "tokens_seen": tokens_seen}, tmp / "trainer_state.pt")
    if path.exists():
        old = path.with_name(path.name + ".old")
        path.rename(old)
        tmp.rename(path)
        import shutil

        shutil.rmtree(old)
    else:
        tmp.rename(path)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=EMBEDDED_TARGET)
    ap.add_argument("--target-name", default=None, help="name recorded in the drafter config (default: --target)")
    ap.add_argument("--data", required=True, nargs="+",
                    help="folder(s) written by dflash2_tools.regenerate, read in the order given")
    ap.add_argument("--out", required=True)
    ap.add_argument("--init-from", default=None, help="start from this drafter's weights (architecture options are then ignored)")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--num-context-layers", type=int, default=4, help="target layers tapped (spread over the target)")
    ap.add_argument("--target-layer-ids", type=int, nargs="*", default=None)
    ap.add_argument("--intermediate-size", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--sliding-window", type=int, default=None)
    ap.add_argument("--mask-token-id", type=int, required=False, default=None)
    ap.add_argument("--conv-group-size", type=int, default=16)
    ap.add_argument("--selector-rank", type=int, default=64)
    ap.add_argument("--selector-top-k", type=int, default=16)
    ap.add_argument("--no-conv", action="store_true", help="plain DFlash layers (ablation)")
    ap.add_argument("--no-selector", action="store_true", help="no candidate selector (ablation)")
    ap.add_argument("--selector-weight", type=float, default=1.0)
    ap.add_argument("--gamma", type=float, default=None, help="position-decay of the loss weights (default: 4 for B=8, 7 for B=16)")
    ap.add_argument("--max-len", type=int, default=768)
    ap.add_argument("--max-response-tokens", type=int, default=None,
                    help="train (and evaluate) on the first N response tokens only. Why: a small target's long "
                    "greedy responses end in loops (data/smollm2-sharegpt: 80%% of 4-grams in response tokens 128-256 "
                    "repeat earlier ones, 33%% in tokens 0-128; see dflash2_tools.data_stats), which are cheap to "
                    "learn and inflate the dev acceptance")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument(
        "--blocks-per-seq",
        type=int,
        default=24,
        help="random-anchor blocks per sequence per step; the target forward is paid once per sequence, "
        "so more blocks amortise it (the LM-head cross-entropy then dominates)",
    )
    ap.add_argument("--length-bucket", type=int, default=64,
                    help="batch sequences of similar length: sort windows of this many batches by length "
                    "(0: plain random batches; see batch_indices)")
    ap.add_argument(
        "--feature-cache",
        choices=["auto", "memory", "online"],
        default="auto",
        help="memory: one target pass up front, features kept in RAM (cheaper from the 2nd epoch on); "
        "online: a target forward every step (no memory cost); auto: memory when it fits in --cache-gb",
    )
    ap.add_argument("--cache-gb", type=float, default=8.0)
    ap.add_argument("--feature-cache-dir", default=None,
                    help="keep the feature cache on disk here (one .npy per target/layers/data, memory-mapped): "
                    "the first run pays the target pass, later runs on the same data start training at once")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--warmup", type=float, default=0.04)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--max-steps", type=int, default=4000, help="total steps of the cosine schedule")
    ap.add_argument("--stop-after", type=int, default=None, help="stop (resumably) after this step")
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--eval-sequences", type=int, default=48)
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                    help="bf16 autocast or fp32; auto: bf16 on GPUs and CPUs with AVX-512 bf16 / AMX only (on an AVX2 CPU "
                    "a bf16 step measured ~27x slower, see precision.py)")
    ap.add_argument("--bf16", dest="precision", action="store_const", const="bf16", help="same as --precision bf16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-only", action="store_true",
                    help="evaluate the drafter (OUT's checkpoint, else --init-from) on the dev split, print the JSON record, exit")
    ap.add_argument("--threads", type=int, default=None)
    return ap.parse_args(argv)


def main(argv=None):
    from accelerate import Accelerator

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    device = accelerator.device
    out = Path(args.out)
    ckpt = out / "checkpoint"
    log_path = out / "log.jsonl"
    is_main = accelerator.is_main_process
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
    if args.mask_token_id is None:
        raise SystemExit("--mask-token-id is required: an id of the target's vocabulary that never occurs in text")

    if ckpt.exists():
        drafter = root.load_drafter(ckpt, dtype=torch.float32)
        state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
        step, tokens_seen = state["step"], state["tokens_seen"]
    elif args.init_from:  # warm start (e.g. from the shipped bf16 weights): same architecture, fresh optimizer
        drafter = root.load_drafter(args.init_from, dtype=torch.float32)
        state, step, tokens_seen = None, 0, 0
    else:
        drafter = root.model_class()._from_config(build_drafter_config(target, args), dtype=torch.float32)
        state, step, tokens_seen = None, 0, 0
    drafter.to(device).train()
    n_params = sum(p.numel() for p in drafter.parameters())
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
    drafter, optimizer = accelerator.prepare(drafter, optimizer)
    raw = accelerator.unwrap_model(drafter)

    sequences = load_chunks(args.data)
    train, dev = split_sequences(sequences, args.max_len, args.max_response_tokens)
    if not train:
        raise SystemExit(f"no training sequences in {args.data}: run python -m dflash2_tools.regenerate first")
    train_lengths = [len(tokens) for tokens, _ in train]

    use_bf16 = args.precision == "bf16" or (args.precision == "auto" and bf16_is_fast(device.type))

    def autocast():
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_bf16)

    if is_main:
        print(
            f"drafter: {n_params / 1e6:.2f}M params, {raw.config.num_hidden_layers} layers, block {raw.config.block_size}, "
            f"target layers {raw.config.target_layer_ids}; {'bf16 autocast' if use_bf16 else 'fp32'}; data: {len(train)} train / {len(dev)} dev sequences; "
            + (f"resuming at step {step}" if step else "starting"),
            flush=True,
        )
    if args.eval_only or (is_main and step == 0 and args.init_from and not log_path.exists()):
        # a warm start logs where it starts, on ITS dev split, so its learning curve has a baseline
        record = {"step": step, "tokens_seen": tokens_seen, "loss": None, "dev": evaluate(raw, target, dev, args, device, autocast)}
        if args.eval_only:
            print(json.dumps(record), flush=True)
            return
        with open(log_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        tqdm.write(f"step 0 (warm start from {args.init_from}): dev acceptance selector {record['dev'].get('acceptance_length_selector', float('nan')):.2f}"
                   f" (on-policy {record['dev'].get('on_policy_acceptance_length_selector', float('nan')):.2f})")
    n_ctx = len(raw.config.target_layer_ids)
    cache_bytes = sum(len(t) for t, _ in train) * n_ctx * raw.config.hidden_size * 2
    use_cache = args.feature_cache == "memory" or (
        args.feature_cache == "auto" and (args.feature_cache_dir is not None or cache_bytes < args.cache_gb * 2**30)
    )
    cached = None
    if use_cache:
        t0 = time.time()
        cache_file = None
        if args.feature_cache_dir:
            key = feature_cache_key(args.target_name, raw.config.target_layer_ids, raw.config.target_hidden_reduction, use_bf16, train)
            cache_file = Path(args.feature_cache_dir) / f"features-{key}.npy"

        def fill_or_load():
            return cache_features(target, train, raw.config.target_layer_ids, raw.config.target_hidden_reduction,
                                  args.batch_size * 2, device, autocast, args.pad_id, path=cache_file)

        if cache_file is None or is_main:  # with a shared file, the main process writes it and the others load it
            cached = fill_or_load()
        accelerator.wait_for_everyone()
        if cached is None:
            cached = fill_or_load()
        if is_main:
            print(f"cached features of {len(train)} sequences ({cache_bytes / 2**30:.2f} GiB) in {time.time() - t0:.0f} s", flush=True)
    stop = min(args.stop_after or args.max_steps, args.max_steps)
    bar = tqdm(total=stop, initial=step, desc="training", unit="step", disable=not is_main)
    t_last = time.time()
    while step < stop:
        idx = batch_indices(train_lengths, args.batch_size, step, args.seed, accelerator.process_index,
                            accelerator.num_processes, args.length_bucket)
        tokens, lengths, prompt_lengths = collate([train[i] for i in idx], args.pad_id)
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 64 + accelerator.process_index)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.max_steps, args.lr, args.warmup)
        with autocast():
            if cached is not None:
                feats = stack_features(cached, idx, tokens.shape[1]).to(device)
            else:
                feats = target_features(target, tokens.to(device), lengths.to(device), raw.config.target_layer_ids, raw.config.target_hidden_reduction)
            loss, metrics = compute_loss(drafter, target, (tokens.to(device), lengths, prompt_lengths), feats, generator, args)
        accelerator.backward(loss)
        grad_norm = accelerator.clip_grad_norm_(drafter.parameters(), args.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += int(lengths.sum()) * accelerator.num_processes
        bar.update(1)
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", ce=f"{metrics['ce']:.3f}")
        record = None
        if is_main and (step % args.eval_every == 0 or step == stop):
            record = {"step": step, "tokens_seen": tokens_seen, "loss": float(loss.detach()), **metrics, "grad_norm": float(grad_norm),
                      "lr": optimizer.param_groups[0]["lr"], "sec_per_step": (time.time() - t_last) / args.eval_every}
            record["dev"] = evaluate(raw, target, dev, args, device, autocast)
            t_last = time.time()
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            dv = record["dev"]
            tqdm.write(
                f"step {step}: loss {record['loss']:.3f} | dev acceptance argmax {dv['acceptance_length_argmax']:.2f}"
                + (f" selector {dv['acceptance_length_selector']:.2f}" if "acceptance_length_selector" in dv else "")
                + f" (on-policy {dv.get('on_policy_acceptance_length_selector', dv['on_policy_acceptance_length_argmax']):.2f})"
                + f" | top1 pos1 {dv['top1_per_position'][0]:.2f} pos{raw.config.block_size - 1} {dv['top1_per_position'][-1]:.2f}"
            )
        if is_main and (step % args.save_every == 0 or step == stop):
            save_checkpoint(ckpt, drafter, optimizer, step, tokens_seen, accelerator)
        accelerator.wait_for_everyone()
    bar.close()


if __name__ == "__main__":
    main()
