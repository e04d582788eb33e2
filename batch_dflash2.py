"""Batched speculative decoding: ``target.generate(**tok(prompts, padding=True, return_tensors="pt"), assistant_model=drafter)``.

Rows share every forward but not their progress: each row accepts its own number of tokens per step. The caches
are written at the same slots for every row; slots a row does not keep become holes its mask hides
(``holes_dflash2``), so each row computes what it would alone. A step, after the batched prefill:

    1. propose, per row: that row's hybrid rule (its own history, the batch's costs) picks its block draft, its
       n-gram continuation or nothing; ONE drafter forward drafts for every row (``batch_proposer_dflash2``)
    2. verify: ONE target forward over [rows, 1 + L] (L: the length the batch's cost model keeps)
    3. accept, per row: the target's choice after every node of every row (argmax, or an exact draw: min(1, p/q) for
       drafted tokens; ``accept_dflash2``), ONE transfer for the batch, then each row's walk; EOS and length per row
    4. commit: the slots no row kept are cropped, the rest of the step's slots become holes where a row did not
       keep them; a finished row leaves the batch (its cache rows are dropped)

The output is transformers' batched ``generate``'s: finished rows are padded with ``pad_token_id`` up to the
longest row; streamers get the same [b] columns, in order, as from transformers' loop (a column once every running
row has it). ``return_dict_in_generate`` gives sequences, scores and logits (a finished row's later columns put all
mass on ``pad_token_id``), and no cache: this one has holes and only the rows still running at the end, so it
could not continue a generation.
"""

from __future__ import annotations

import itertools
import time

import torch
from transformers.cache_utils import DynamicLayer

from .accept_dflash2 import target_choices, walk
from .attention_dflash2 import verification_attention
from .batch_proposer_dflash2 import BatchProposer
from .holes_dflash2 import compact, crop_tail, kept_mask, positions_from_mask, select_rows, should_compact
from .loop_dflash2 import chain_tree

MASKED_ATTENTION = ("sdpa", "eager", "flex_attention")  # kernels that take a 2D mask with holes


def refuse_unsupported_batch(target, drafter, generation_config, cache, budget: int) -> None:
    """What batches do not serve (yet), as clear errors before the first forward."""
    fix = "or generate prompt by prompt (batch size 1), where it is supported"
    if cache is None:
        raise ValueError("DFlash 2 speculative decoding needs the target's cache: pass use_cache=True")
    if budget:
        raise ValueError(f"tree verification (tree_budget={budget}) runs batch size 1: set drafter.config.tree_budget = 0 "
                         f"(one path per row) for batches, {fix}")
    if generation_config.return_dict_in_generate and (generation_config.output_attentions or generation_config.output_hidden_states):
        raise ValueError("DFlash 2 speculative decoding returns sequences, scores, logits and the cache, not attentions or "
                         "hidden states: drop output_attentions/output_hidden_states")
    if getattr(target, "_is_stateful", False):
        raise ValueError("a stateful target (linear attention) keeps one recurrent state per row that a batch cannot roll "
                         f"back row by row: {fix}")
    kinds = sorted({type(layer).__name__ for layer in getattr(cache, "layers", []) if type(layer) is not DynamicLayer})
    if kinds:
        raise ValueError(f"batched DFlash 2 keeps per-row holes in full-attention dynamic caches; this cache has {kinds} "
                         f"(a static cache, sliding windows or extra state): use the default dynamic cache "
                         f"(cache_implementation=None) with full attention, {fix}")
    for who, model in (("target", target), ("drafter", drafter)):
        implementation = model.config._attn_implementation
        if implementation not in MASKED_ATTENTION and not str(implementation).startswith("sdpa"):
            raise ValueError(f"the {who}'s attention implementation {implementation!r} takes no mask with holes, which a "
                             f"batch needs: load it with attn_implementation='sdpa', {fix}")
    if drafter.config.sliding_window is not None and any(t == "sliding_attention" for t in drafter.config.layer_types):
        raise ValueError(f"a drafter with sliding-window layers cannot skip holes in its window: {fix}")


def as_row(fn, ids: list[int], row: int, rows: int, device, scores: torch.Tensor | None = None):
    """``fn(input_ids, scores)`` (a logits-processor or stopping-criteria list) for ONE row of the caller's batch.

    Processors may hold per-row state sized for the caller's batch (``prompt_ignore_length``, per-row prefixes), and
    rows here have different lengths, so the call gets a full-size batch whose every row is this row's sequence,
    and answers with row ``row``: what transformers' loop would compute for that row at that length."""
    batch_ids = torch.tensor([ids], device=device).expand(rows, -1)  # [rows, T]
    if scores is None:
        return fn(batch_ids, None)[row]
    return fn(batch_ids, scores[None].expand(rows, -1).clone())[row]  # [V]


def process_chain(logits: torch.Tensor, tree, prefix: list[int], row: int, rows: int, logits_processor, device) -> torch.Tensor:
    """Processed logits [N, V] of one row's chain (``logits`` [N, V]): node k's processors see the row's sequence
    ``prefix`` and the chain's first k tokens, through ``as_row``."""
    if not len(logits_processor):
        return logits
    return torch.stack([as_row(logits_processor, prefix + tree.tokens[1 : k + 1], row, rows, device, logits[k])
                        for k in range(len(tree))])  # [N, V]


@torch.no_grad()
def batched_speculative_decoding(target, drafter, input_ids, logits_processor, stopping_criteria, generation_config,
                                 streamer=None, budget: int = 0, **model_kwargs):
    """``speculative_decoding`` for a batch of left-padded prompts: same inputs and outputs as transformers' batched
    ``generate`` (module doc)."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    cache = model_kwargs.get("past_key_values")
    refuse_unsupported_batch(target, drafter, generation_config, cache, budget)
    rows, prompt_length = input_ids.shape
    device = input_ids.device
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    host_ids, host_mask = input_ids.tolist(), attention_mask.tolist()
    proposer = BatchProposer(target, drafter, generation_config,
                             [[t for t, m in zip(ids, mask) if m] for ids, mask in zip(host_ids, host_mask)])
    stats = proposer.stats
    do_sample = bool(generation_config.do_sample)
    eos = getattr(generation_config, "_eos_token_tensor", None)
    eos = set() if eos is None else set(eos.view(-1).tolist())
    pad = generation_config._pad_token_tensor
    pad = int(pad) if pad is not None else (min(eos) if eos else 0)
    return_dict = generation_config.return_dict_in_generate
    want_scores = return_dict and generation_config.output_scores
    want_logits = return_dict and generation_config.output_logits
    layers = [i + 1 for i in drafter.config.target_layer_ids]
    greedy_argmax = not do_sample and not len(logits_processor)  # accept by one argmax over the batch
    generated = [[] for _ in range(rows)]  # per caller row: new tokens (host)
    row_scores = [[] for _ in range(rows)]
    row_raw = [[] for _ in range(rows)]

    # prefill, positioned as transformers' generate positions a left-padded batch
    out = target(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions_from_mask(attention_mask),
                 past_key_values=cache, use_cache=True, output_hidden_states=layers, logits_to_keep=1)
    proposer.add_prompt(out.hidden_states, attention_mask)
    raw = out.logits[:, -1].float()  # [b, V]
    first = logits_processor(input_ids, raw.clone()) if len(logits_processor) else raw.clone()
    tokens = torch.multinomial(torch.softmax(first, -1), 1)[:, 0] if do_sample else first.argmax(-1)  # [b]
    new = [[t] for t in tokens.tolist()]
    for r in range(rows):
        if want_scores:
            row_scores[r].append(first[r])
        if want_logits:
            row_raw[r].append(raw[r])
    active = list(range(rows))  # caller rows still generating, in batch order
    kv_mask = attention_mask.long()  # [b, T] 1 = a real entry of the target's cache
    real = attention_mask.sum(-1).tolist()  # real entries per row (= the next position)
    streamed = 0
    while True:
        # commit the step's tokens; finished rows leave
        still = []
        for i, r in enumerate(active):
            generated[r] += new[i]
            if not (eos and generated[r][-1] in eos) and not as_row(stopping_criteria, host_ids[r] + generated[r], r, rows, device):
                still.append(i)
        streamed = _stream(streamer, generated, active, still, streamed, pad)
        if not still:
            break
        if len(still) < len(active):
            index = torch.tensor(still, device=device)
            select_rows(cache, index)
            kv_mask = kv_mask.index_select(0, index)
            proposer.keep_rows(still)
            active, new, real = [active[i] for i in still], [new[i] for i in still], [real[i] for i in still]
        anchors = [generated[r][-1] for r in active]
        limits = [generation_config.max_length - prompt_length - len(generated[r]) - 1 for r in active]  # drafts that fit

        # 1. propose (one drafter forward for the batch)
        proposals = proposer.propose(anchors, new, limits)
        width = 1 + max(len(p.tokens) for p in proposals)  # [anchor] + the longest proposal

        # 2. verify every row in one forward; shorter rows are padded with their anchor (slots that become holes)
        step_ids = torch.tensor([[a] + p.tokens + [a] * (width - 1 - len(p.tokens)) for a, p in zip(anchors, proposals)], device=device)
        positions = torch.tensor(real, device=device)[:, None] + torch.arange(width, device=device)  # [b, 1 + L]
        with verification_attention(target):  # packed GQA heads: no copy of the whole cache per layer under the mask
            out = target(input_ids=step_ids, position_ids=positions, attention_mask=torch.cat([kv_mask, kv_mask.new_ones(len(active), width)], 1),
                         past_key_values=cache, use_cache=True, output_hidden_states=layers)
        logits = out.logits.float()  # [b, 1 + L, V]

        # 3. accept, per row, from the target's choice after every node: ONE transfer for the batch
        trees = [chain_tree(a, p.tokens) for a, p in zip(anchors, proposals)]
        if greedy_argmax:
            node_logits = logits  # [b, 1 + L, V]
            choices = logits.argmax(-1).tolist()  # [b][1 + L]
        else:
            node_logits = [process_chain(logits[i, : len(tree)], tree, host_ids[r] + generated[r], r, rows, logits_processor,
                                         device) for i, (r, tree) in enumerate(zip(active, trees))]  # b x [N_i, V]
            drawn = torch.cat([target_choices(tree, row_logits, do_sample, p.log_q)
                               for tree, row_logits, p in zip(trees, node_logits, proposals)]).tolist()
            ends = list(itertools.accumulate(len(tree) for tree in trees))
            choices = [drawn[end - len(tree): end] for tree, end in zip(trees, ends)]
        new, kept = [], []
        for i, (r, tree) in enumerate(zip(active, trees)):
            path, bonus = walk(tree, choices[i])
            accepted = [tree.tokens[k] for k in path[1:]]
            row_new = (accepted + [bonus])[: max(1, generation_config.max_length - prompt_length - len(generated[r]))]
            cut = next((k for k, t in enumerate(row_new) if t in eos), None)
            row_new = row_new if cut is None else row_new[: cut + 1]
            new.append(row_new)
            kept.append(len(row_new))  # the anchor and the accepted nodes whose successors are committed
            if want_scores:
                row_scores[r] += [node_logits[i][k] for k in range(len(row_new))]
            if want_logits:
                row_raw[r] += [logits[i, k] for k in range(len(row_new))]
        proposer.record(proposals, [k - 1 for k in kept])

        # 4. commit: the tail no row kept goes, the rest are holes where a row did not keep them
        longest = max(kept)
        crop_tail(cache, width - longest)
        step_mask = kept_mask(kept, longest, device)  # [b, K]
        kv_mask = torch.cat([kv_mask, step_mask], dim=1)
        real = [n + k for n, k in zip(real, kept)]
        proposer.add_kept(out.hidden_states, step_mask)
        if should_compact(kv_mask.shape[1], real):
            kv_mask = compact(cache, kv_mask)

    stats.new_tokens = sum(len(g) for g in generated)
    stats.seconds = time.perf_counter() - proposer.start_time
    if streamer is not None:
        streamer.end()
    longest = max(len(g) for g in generated)
    sequences = torch.cat([input_ids, torch.tensor([g + [pad] * (longest - len(g)) for g in generated], dtype=input_ids.dtype,
                                                   device=device)], dim=1)
    if not return_dict:
        return sequences
    return GenerateDecoderOnlyOutput(sequences=sequences, scores=_columns(row_scores, longest, pad) if want_scores else None,
                                     logits=_columns(row_raw, longest, pad) if want_logits else None, past_key_values=None)


def _columns(per_row: list[list[torch.Tensor]], length: int, pad: int) -> tuple:
    """Per-row lists of [V] -> a tuple of ``length`` [b, V]; a finished row's later columns put all mass on ``pad``
    (the token written there)."""
    template = next(t for row in per_row for t in row)
    filler = torch.full_like(template, float("-inf"))
    filler[pad] = 0.0
    return tuple(torch.stack([row[k] if k < len(row) else filler for row in per_row]) for k in range(length))


def _stream(streamer, generated, active, still, streamed: int, pad: int) -> int:
    """Put the columns every row has reached ([b] tokens, ``pad`` for finished rows), as transformers' loop does."""
    if streamer is None:
        return streamed
    running = [active[i] for i in still]
    reached = min((len(generated[r]) for r in running), default=max(len(g) for g in generated))
    for k in range(streamed, reached):
        streamer.put(torch.tensor([g[k] if k < len(g) else pad for g in generated]))
    return max(streamed, reached)


__all__ = ["batched_speculative_decoding", "refuse_unsupported_batch"]
