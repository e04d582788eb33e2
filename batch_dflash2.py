"""Batched speculative decoding: ``target.generate(**tok(prompts, padding=True, return_tensors="pt"), assistant_model=drafter)``.

Rows share every forward but not their progress: each row accepts its own number of tokens per step. The caches
are written at the same slots for every row; slots a row does not keep become holes its mask hides
(``holes_dflash2``), so each row computes what it would alone. A step, after the batched prefill:

    1. propose, per row: that row's hybrid rule (its own history, the batch's costs) picks its block draft, its
       n-gram continuation or nothing; or, with ``drafter.config.tree_budget = N``, the row's own tree (the N most
       probable nodes of its top-K lattice, its n-gram continuation as a branch); ONE drafter forward drafts for
       every row (``batch_proposer_dflash2``)
    2. verify: ONE target forward over [rows, W] (W: the largest proposal plus the anchor); a path verifies under
       the target's own causal mask, trees under a 4D mask (each row's context with its holes, and its ancestors)
    3. accept, per row: the target's choice after every node of every row (argmax, or an exact draw: min(1, p/q) for
       drafted tokens; ``accept_dflash2``), ONE transfer for the batch, then each row's walk; EOS and length per row
    4. commit: trees first move each row's accepted nodes to the front of the step's slots (``kept_first``); the
       slots no row kept are cropped, the rest of the step's slots become holes where a row did not keep them; a
       finished row leaves the batch (its cache rows are dropped)

A static cache (``cache_implementation="static"``) serves too, eagerly (a batch's shapes change as rows finish, so it
is not compiled): the step's tail is cut by setting the layers' length, and the holes are compacted in place whenever
the next step would not fit the slots (``generate``'s cache gets one widest step of room beyond ``max_length``).

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
from transformers.cache_utils import DynamicLayer, StaticLayer

from .accept_dflash2 import target_choices, walk
from .attention_dflash2 import verification_attention
from .batch_proposer_dflash2 import BatchProposer
from .holes_dflash2 import compact, crop_tail, kept_first, kept_mask, positions_from_mask, select_rows, should_compact
from .loop_dflash2 import chain_tree, reserve_verification_slots
from .tree_dflash2 import refuse_unsupported, static_cache_length, tree_attention_mask

MASKED_ATTENTION = ("sdpa", "eager", "flex_attention")  # kernels that take a 2D mask with holes


def refuse_unsupported_batch(target, drafter, generation_config, cache, budget: int) -> None:
    """What batches do not serve (yet), as clear errors before the first forward."""
    fix = "or generate prompt by prompt (batch size 1), where it is supported"
    if cache is None:
        raise ValueError("DFlash 2 speculative decoding needs the target's cache: pass use_cache=True")
    if budget:
        refuse_unsupported(target, generation_config, cache)
    if generation_config.return_dict_in_generate and (generation_config.output_attentions or generation_config.output_hidden_states):
        raise ValueError("DFlash 2 speculative decoding returns sequences, scores, logits and the cache, not attentions or "
                         "hidden states: drop output_attentions/output_hidden_states")
    if getattr(target, "_is_stateful", False):
        raise ValueError("a stateful target (linear attention) keeps one recurrent state per row that a batch cannot roll "
                         f"back row by row: {fix}")
    kinds = sorted({type(layer).__name__ for layer in getattr(cache, "layers", []) if type(layer) not in (DynamicLayer, StaticLayer)})
    if kinds:
        raise ValueError(f"batched DFlash 2 keeps per-row holes in full-attention dynamic or static caches; this cache has "
                         f"{kinds} (sliding windows or extra state): use the default dynamic cache (cache_implementation=None) "
                         f"with full attention, {fix}")
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


def stopping_rows(stopping_criteria, sequences: dict[int, list[int]], rows: int, device) -> set[int]:
    """The caller rows (keys of ``sequences``: row -> its sequence) whose stopping criteria fire. One call and one
    transfer per group of rows of equal length: the call gets a full-size batch in which each row of the group holds
    its own sequence (the others repeat one of them), so each row sees what ``as_row`` would give it."""
    by_length: dict[int, list[int]] = {}
    for r, ids in sequences.items():
        by_length.setdefault(len(ids), []).append(r)
    stopped = set()
    for group in by_length.values():
        batch = [sequences[group[0]]] * rows
        for r in group:
            batch[r] = sequences[r]
        fired = stopping_criteria(torch.tensor(batch, device=device), None).tolist()  # [rows]
        stopped.update(r for r in group if fired[r])
    return stopped


def process_tree(logits: torch.Tensor, tree, prefix: list[int], row: int, rows: int, logits_processor, device) -> torch.Tensor:
    """Processed logits [N, V] of one row's tree (``logits`` [N, V]): node k's processors see the row's sequence
    ``prefix`` and the tree tokens from the root's child down to node k, through ``as_row``."""
    if not len(logits_processor):
        return logits
    return torch.stack([as_row(logits_processor, prefix + path, row, rows, device, logits[k])
                        for k, path in enumerate(tree.prefixes())])  # [N, V]


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
    # the widest verification step: [anchor] + a tree (+ its n-gram branch) or the longest path
    widest = 1 + (budget + proposer.ngram_tokens if budget else max(proposer.draft_limit, proposer.ngram_tokens))
    reserve_verification_slots(cache, generation_config, widest)  # a static cache generate made gets room for it
    slots = static_cache_length(cache)  # None: a dynamic cache
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
        for i, r in enumerate(active):
            generated[r] += new[i]
        unfinished = {r: host_ids[r] + generated[r] for r in active if not (eos and generated[r][-1] in eos)}
        stopped = stopping_rows(stopping_criteria, unfinished, rows, device)
        still = [i for i, r in enumerate(active) if r in unfinished and r not in stopped]
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
        if slots is not None:  # a static cache: the step's slots must fit after the holes (compacted when they would not)
            if kv_mask.shape[1] + widest > slots:
                kv_mask = compact(cache, kv_mask)
            limits = [min(limit, slots - kv_mask.shape[1] - 1) for limit in limits]
        room = None if slots is None else slots - kv_mask.shape[1] - 1  # nodes after the anchor that fit the slots

        # 1. propose (one drafter forward for the batch): a path per row (the row's rule), or a tree per row
        if budget:
            proposals, trees = None, proposer.propose_trees(anchors, new, limits, budget, room)
        else:
            proposals = proposer.propose(anchors, new, limits)
            trees = [chain_tree(a, p.tokens) for a, p in zip(anchors, proposals)]
        width = max(len(tree) for tree in trees)  # [anchor] + the largest proposal

        # 2. verify every row in one forward; smaller trees are padded with their anchor (slots that become holes)
        start = kv_mask.shape[1]  # the step's first slot
        step_ids = torch.tensor([tree.tokens + [tree.tokens[0]] * (width - len(tree)) for tree in trees], device=device)
        depths = torch.tensor([tree.depths + [0] * (width - len(tree)) for tree in trees], device=device)  # [b, W]
        positions = torch.tensor(real, device=device)[:, None] + depths  # [b, W]
        if budget:  # each row's tree: its context (holes masked) and its own ancestors
            key_length = slots if slots is not None else start + width
            mask = torch.cat([tree_attention_mask(tree, kv_mask[i], target.dtype, key_length, width)
                              for i, tree in enumerate(trees)])  # [b, 1, W, key_length]
        else:  # chains: the target's own causal mask over the step's slots
            mask = torch.cat([kv_mask, kv_mask.new_ones(len(active), width)], 1)  # [b, T + W]
        with verification_attention(target):  # packed GQA heads: no copy of the whole cache per layer under the mask
            out = target(input_ids=step_ids, position_ids=positions, attention_mask=mask, past_key_values=cache, use_cache=True,
                         output_hidden_states=layers)
        logits = out.logits.float()  # [b, W, V]

        # 3. accept, per row, from the target's choice after every node: ONE transfer for the batch
        if greedy_argmax:
            node_logits = logits  # [b, W, V]
            choices = logits.argmax(-1).tolist()  # [b][W]
        else:
            node_logits = [process_tree(logits[i, : len(tree)], tree, host_ids[r] + generated[r], r, rows, logits_processor,
                                        device) for i, (r, tree) in enumerate(zip(active, trees))]  # b x [N_i, V]
            drawn = torch.cat([target_choices(tree, row_logits, do_sample, None if proposals is None else proposals[i].log_q)
                               for i, (tree, row_logits) in enumerate(zip(trees, node_logits))]).tolist()
            ends = list(itertools.accumulate(len(tree) for tree in trees))
            choices = [drawn[end - len(tree): end] for tree, end in zip(trees, ends)]
        new, kept, paths = [], [], []
        for i, (r, tree) in enumerate(zip(active, trees)):
            path, bonus = walk(tree, choices[i])
            accepted = [tree.tokens[k] for k in path[1:]]
            row_new = (accepted + [bonus])[: max(1, generation_config.max_length - prompt_length - len(generated[r]))]
            cut = next((k for k, t in enumerate(row_new) if t in eos), None)
            row_new = row_new if cut is None else row_new[: cut + 1]
            new.append(row_new)
            kept.append(len(row_new))  # the anchor and the accepted nodes whose successors are committed
            paths.append(path)
            if want_scores:
                row_scores[r] += [node_logits[i][k] for k in path[: len(row_new)]]
            if want_logits:
                row_raw[r] += [logits[i, k] for k in path[: len(row_new)]]
        if budget:
            proposer.record_trees(trees, [k - 1 for k in kept])
        else:
            proposer.record(proposals, [k - 1 for k in kept])

        # 4. commit: trees first move each row's kept nodes to the front of the step's slots; then the tail no row
        # kept goes, and the rest are holes where a row did not keep them
        order = None
        if budget:
            order = torch.tensor([p + [k for k in range(width) if k not in p] for p in paths], device=device)  # [b, W]
            kept_first(cache, start, order)
        longest = max(kept)
        crop_tail(cache, width - longest)
        step_mask = kept_mask(kept, longest, device)  # [b, K]
        kv_mask = torch.cat([kv_mask, step_mask], dim=1)
        real = [n + k for n, k in zip(real, kept)]
        proposer.add_kept(out.hidden_states, step_mask, order)
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
