"""The decoding loop behind ``target.generate(**inputs, assistant_model=drafter)``: every call, one loop.

A call is a batch of rows (one prompt is a batch of one); rows share every forward, not their progress. A step:

    1. propose, per row: a path (the row's hybrid rule: block draft, n-gram continuation or nothing; the batch
       verifies one length) or a tree (the row's top-K lattice plus its n-gram branch); ONE drafter forward
    2. verify: ONE target forward over [rows, W] ([anchor] + the largest proposal; smaller ones padded)
    3. accept, per row: the target's choice after every node, ONE transfer for the batch, then the row's walk
       (``accept_dflash2``: greedy, or exact sampling); EOS and length per row
    4. commit: accepted tree nodes move to the front of the step's slots, the slots no row kept are cropped, and
       the kept nodes' hidden states become the drafter's next context features

Rows that keep different numbers of tokens share a cache in one of two ways, decided before the first forward:

* holes (full-attention targets on dynamic or static caches, at batch > 1): a row that kept fewer slots leaves
  HOLES its mask hides (``holes_dflash2``) and positions that count real entries, so it computes exactly what it
  would alone; verification runs under that mask (``verification_attention``: SDPA for sdpa and flash targets);
* lockstep (one row; stateful targets, sliding windows, other kernels): every row commits the step's LEAST count (a
  prefix of what it accepted: still the target's tokens), so the cache stays rectangular and chains run on the
  target's own kernel and 2D masks; linear-attention states are rolled back and replayed (``rollback_dflash2``).

With a static cache and ``torch.compile`` (transformers' rule) verification widths are padded to powers of two,
finished rows stay as dead rows and the drafter step runs one graph on a preallocated cache: a handful of graphs
serves every call. The output is ``generate``'s: finished rows padded with ``pad_token_id``, streamers get [b]
columns in order, ``return_dict_in_generate`` gives sequences, scores, logits and (one row) the cache.
"""

from __future__ import annotations

import itertools
import time

import torch
from transformers.cache_utils import DynamicLayer, StaticLayer

from .accept_dflash2 import accepted_path, first_argmax, process_tree, target_choices
from .attention_dflash2 import verification_attention
from .holes_dflash2 import compact, crop_tail, kept_first, kept_mask, positions_from_mask, select_rows, should_compact
from .proposer_dflash2 import Proposer
from .rollback_dflash2 import LinearStateRollback
from .tree_dflash2 import (add_branch, refuse_unsupported, root_tree, static_cache_length, target_sliding_window,
                           tree_attention_mask)


def refuse_unsupported_call(target, generation_config, cache, budget: int) -> None:
    """What no call serves, as clear errors before the first forward."""
    if cache is None:
        raise ValueError("DFlash 2 speculative decoding needs the target's cache: pass use_cache=True")
    if generation_config.return_dict_in_generate and (generation_config.output_attentions or generation_config.output_hidden_states):
        raise ValueError("DFlash 2 speculative decoding returns sequences, scores, logits and the cache, not attentions or "
                         "hidden states: drop output_attentions/output_hidden_states")
    static = any(isinstance(layer, StaticLayer) for layer in getattr(cache, "layers", []))
    if static and getattr(target, "_is_stateful", False):
        raise ValueError("a stateful target (linear attention) on a static cache is not supported with a DFlash 2 drafter: "
                         "use the default dynamic cache (cache_implementation=None)")
    if static and any(type(layer) is not StaticLayer for layer in cache.layers):
        kinds = sorted({type(layer).__name__ for layer in cache.layers} - {"StaticLayer"})
        raise ValueError(f"DFlash 2 on a static cache needs full-attention static layers, this cache also has {kinds}: "
                         "use the default dynamic cache (cache_implementation=None)")
    if budget:
        refuse_unsupported(target, generation_config, cache)


MASKED_ATTENTION = ("sdpa", "eager", "flex_attention")  # kernels that take a mask with holes (flash: switched to SDPA)


def takes_holes(target, cache) -> bool:
    """Can rows of this target and cache skip slots (holes), or must they commit in lockstep? Holes need full
    attention (a window or a recurrent state counts slots, not positions) and a kernel that takes their mask."""
    if getattr(target, "_is_stateful", False) or target_sliding_window(target.config.get_text_config()) is not None:
        return False
    implementation = str(target.config.get_text_config()._attn_implementation)
    if not (implementation in MASKED_ATTENTION or implementation.startswith("sdpa") or "flash" in implementation):
        return False
    return all(type(layer) in (DynamicLayer, StaticLayer) for layer in getattr(cache, "layers", []))


def padded_rows(nodes: int, largest: int) -> int:
    """Rows of a compiled verification forward over ``nodes`` nodes: the next power of two, at most ``largest``."""
    return min(1 << (nodes - 1).bit_length(), largest)


def reserve_verification_slots(cache, generation_config, rows: int) -> None:
    """Room for the widest verification at the very end: a static cache that ``generate`` made for this call and has
    not allocated yet gets ``rows`` slots beyond ``max_length`` (a user's cache keeps its size; steps that would not
    fit it are bounded by its room)."""
    if getattr(cache, "_is_user_defined", False):
        return
    for layer in cache.layers:
        if type(layer) is StaticLayer and not layer.is_initialized:
            layer.max_cache_len = max(layer.max_cache_len, generation_config.max_length + rows)


def chain_tree(anchor: int, tokens: list[int]):
    return add_branch(root_tree(anchor), tokens)


def stopping_rule(stopping_criteria, rows: int, device):
    """A function {caller row: its sequence} -> the rows whose stopping criteria fire. transformers' own length and EOS
    criteria are read once, here, and applied on the host by their rule (no tensor and no transfer per step); any
    other criterion is called once per group of rows of equal length, with one transfer: a full-size batch in which
    each row of the group holds its own sequence (the others repeat one of them), as transformers' loop shows it."""
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

    max_length, eos, others = None, set(), StoppingCriteriaList()
    for criterion in stopping_criteria:
        if type(criterion) is MaxLengthCriteria:  # input_ids.shape[-1] >= max_length
            max_length = min(criterion.max_length, max_length or criterion.max_length)
        elif type(criterion) is EosTokenCriteria:  # the last token is an EOS
            eos |= set(criterion.eos_token_id.view(-1).tolist())
        else:
            others.append(criterion)

    def stopped_rows(sequences: dict[int, list[int]]) -> set[int]:
        stopped = {r for r, ids in sequences.items() if (max_length is not None and len(ids) >= max_length) or ids[-1] in eos}
        if not others:
            return stopped
        by_length: dict[int, list[int]] = {}
        for r, ids in sequences.items():
            by_length.setdefault(len(ids), []).append(r)
        for group in by_length.values():
            batch = [sequences[group[0]]] * rows
            for r in group:
                batch[r] = sequences[r]
            fired = others(torch.tensor(batch, device=device), None).tolist()  # [rows]
            stopped.update(r for r in group if fired[r])
        return stopped

    return stopped_rows


@torch.no_grad()
def speculative_decoding(target, drafter, input_ids, logits_processor, stopping_criteria, generation_config, streamer=None,
                         budget: int = 0, **model_kwargs):
    """transformers' ``_assisted_decoding`` for a DFlash 2 drafter: same inputs and outputs as ``generate`` (module doc).

    ``budget``: tree nodes per step (0: one path per step)."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    cache = model_kwargs.get("past_key_values")
    refuse_unsupported_call(target, generation_config, cache, budget)
    rows, prompt_length = input_ids.shape
    device = input_ids.device
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    host_ids, host_mask = input_ids.tolist(), attention_mask.tolist()
    prompts = [[t for t, m in zip(ids, mask) if m] for ids, mask in zip(host_ids, host_mask)]
    proposer = Proposer(target, drafter, generation_config, prompts)
    stats = proposer.stats
    stats.mode = f"tree-{budget}" if budget else "linear"
    holes = rows > 1 and takes_holes(target, cache)
    rollback = LinearStateRollback(target, owner=proposer) if getattr(target, "_is_stateful", False) else None
    # the widest verification step: [anchor] + a tree (+ its n-gram branch) or the longest path
    longest_draft = drafter.config.block_size - 1 if proposer.adaptive else proposer.draft_limits[0]
    widest = 1 + (budget + proposer.ngram_tokens if budget else max(longest_draft, proposer.ngram_tokens))
    slots = static_cache_length(cache)  # None: a dynamic cache
    compiled = slots is not None and target._valid_auto_compile_criteria(model_kwargs, generation_config)
    reserve_verification_slots(cache, generation_config, widest)  # a static cache generate made gets room for it
    slots = static_cache_length(cache)
    compile_config = None
    if compiled:
        compile_config = generation_config.compile_config or target._default_compile_config()  # what the target gets
        verify_compiled = target.get_compiled_call(compile_config)
    if slots is not None:  # the drafter's context K/V preallocated too; its step compiled with the target's forward
        proposer.preallocate(generation_config.max_length, compile_config)
    own_masks = not holes and not budget and slots is None  # chains on the target's own kernel and 2D masks
    if own_masks:
        cache.activate_past_recording()  # sliding-window and linear-attention layers keep what a crop may need
    stopped_rows = stopping_rule(stopping_criteria, rows, device)
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
    active = list(range(rows))  # caller rows in the batch, in batch order
    live = [True] * rows  # per place in the batch: still generating (compiled calls keep finished rows as dead rows)
    kv_mask = attention_mask.long()  # [b, T] 1 = a real entry of the target's cache
    real = attention_mask.sum(-1).tolist()  # real entries per row (= the next position)
    streamed = 0
    while True:
        # commit the step's tokens; finished rows leave (or stay dead)
        for i, r in enumerate(active):
            if live[i]:
                generated[r] += new[i]
        unfinished = {r: host_ids[r] + generated[r] for i, r in enumerate(active) if live[i] and not (eos and generated[r][-1] in eos)}
        stopped = stopped_rows(unfinished)
        live = [live[i] and r in unfinished and r not in stopped for i, r in enumerate(active)]
        streamed = _stream(streamer, generated, [r for i, r in enumerate(active) if live[i]], streamed, pad)
        if not any(live):
            break
        if not all(live) and not compiled:
            still = [i for i, alive in enumerate(live) if alive]
            index = torch.tensor(still, device=device)
            select_rows(cache, index)
            kv_mask = kv_mask.index_select(0, index)
            proposer.keep_rows(still)
            active, new, real, live = [active[i] for i in still], [new[i] for i in still], [real[i] for i in still], [True] * len(still)
        anchors = [generated[r][-1] for r in active]
        limits = [generation_config.max_length - prompt_length - len(generated[r]) - 1 if alive else 0
                  for r, alive in zip(active, live)]  # drafts that fit
        if slots is not None:  # a static cache: the step's slots must fit after the holes (compacted when they would not)
            if holes and kv_mask.shape[1] + widest > slots:
                kv_mask = compact(cache, kv_mask)
            limits = [min(limit, slots - kv_mask.shape[1] - 1) for limit in limits]
        room = None if slots is None else slots - kv_mask.shape[1] - 1  # nodes after the anchor that fit the slots
        if rollback is not None:  # every forward after the prefill needs full conv windows
            rollback.pad_conv_windows(cache)

        # 1. propose (one drafter forward for the batch): a path per row (the row's rule), or a tree per row
        if budget:
            proposals, trees = None, proposer.propose_trees(anchors, new, limits, budget, room)
        else:
            proposals = proposer.propose(anchors, new, limits)
            trees = [chain_tree(a, p.tokens) for a, p in zip(anchors, proposals)]
        width = max(len(tree) for tree in trees)  # [anchor] + the largest proposal

        # 2. verify every row in one forward; smaller trees are padded with their anchor (slots that become holes)
        start = kv_mask.shape[1]  # the step's first slot
        n_rows = padded_rows(width, widest) if compiled else width
        padded = compiled and start + n_rows <= slots  # a compiled graph per row count; else an eager forward
        n_rows = n_rows if padded else width
        step_ids, positions = torch.tensor([[tree.tokens + [tree.tokens[0]] * (n_rows - len(tree)) for tree in trees],
                                            [[n + d for d in tree.depths] + [n] * (n_rows - len(tree)) for n, tree in zip(real, trees)]],
                                           device=device)  # [2, b, W]: one copy for the ids and their positions
        if rollback is not None and width > 1:
            rollback.begin_step(cache)
        if own_masks:  # the target's own kernel and masks (a rectangular cache: lockstep)
            out = target(input_ids=step_ids, position_ids=positions, attention_mask=torch.cat([kv_mask, kv_mask.new_ones(len(active), width)], 1),
                         past_key_values=cache, use_cache=True, output_hidden_states=layers)
        else:
            if budget or slots is not None:  # each row's tree (a chain is one): its context (holes masked), its ancestors
                key_length = slots if slots is not None else start + n_rows
                mask = tree_attention_mask(trees, kv_mask, target.dtype, key_length, n_rows)  # [b, 1, W, key_length]
            else:  # chains: the target's causal mask over the step's slots, holes masked
                mask = torch.cat([kv_mask, kv_mask.new_ones(len(active), width)], 1)  # [b, T + W]
            with verification_attention(target):  # packed GQA heads: no copy of the whole cache per layer under the mask
                out = (verify_compiled if padded else target)(
                    input_ids=step_ids, position_ids=positions, attention_mask=mask, past_key_values=cache, use_cache=True,
                    output_hidden_states=layers)
        logits = out.logits[:, :width].float()  # [b, W, V]
        if padded:
            logits = logits.clone()  # a CUDA-graph replay reuses its output memory at the next step

        # 3. accept, per row, from the target's choice after every node: ONE transfer for the batch
        if greedy_argmax:
            node_logits = logits  # [b, W, V]
            choices = first_argmax(logits).tolist()  # [b][W]
        else:
            node_logits = [process_tree(logits[i, : len(tree)], tree, host_ids[r] + generated[r], r, rows, logits_processor)
                           for i, (r, tree) in enumerate(zip(active, trees))]  # b x [N_i, V]
            drawn = torch.cat([target_choices(tree, row_logits, do_sample, None if proposals is None else proposals[i].log_q)
                               for i, (tree, row_logits) in enumerate(zip(trees, node_logits))]).tolist()
            ends = list(itertools.accumulate(len(tree) for tree in trees))
            choices = [drawn[end - len(tree): end] for tree, end in zip(trees, ends)]
        new, paths = [], []
        for i, (r, tree) in enumerate(zip(active, trees)):
            path, bonus = accepted_path(tree, choices[i])
            row_new = ([tree.tokens[k] for k in path[1:]] + [bonus])[: max(1, generation_config.max_length - prompt_length - len(generated[r]))]
            cut = next((k for k, t in enumerate(row_new) if t in eos), None)
            new.append(row_new if cut is None else row_new[: cut + 1])
            paths.append(path)
        if not holes:  # lockstep: every row commits the least any live row commits (a prefix of its own: still exact)
            least = min(len(row_new) for row_new, alive in zip(new, live) if alive)
            new = [row_new[:least] for row_new in new]
        kept = [len(row_new) if alive or not holes else 0 for row_new, alive in zip(new, live)]  # slots each row keeps
        for i, r in enumerate(active):
            if live[i] and want_scores:
                row_scores[r] += [node_logits[i][k] for k in paths[i][: kept[i]]]
            if live[i] and want_logits:
                row_raw[r] += [logits[i, k] for k in paths[i][: kept[i]]]
        proposer.record([k - 1 if alive else None for k, alive in zip(kept, live)], proposals, None if proposals is not None else trees)

        # 4. commit: trees first move each row's kept nodes to the front of the step's slots; then the tail no row
        # kept goes, and the rest are holes where a row did not keep them
        longest = max(kept)
        order = kept_first(cache, start, paths, longest)  # None for chains (nothing moves)
        crop_tail(cache, n_rows - longest)  # also shrinks sliding-window / conv layers back to their size
        if rollback is not None and width > 1:
            rollback.finish_step(accepted=longest, fed=n_rows)
            stats.rollback_seconds = rollback.seconds
        step_mask = kept_mask(kept, longest, device)  # [b, K]
        kv_mask = torch.cat([kv_mask, step_mask], dim=1)
        real = [n + k for n, k in zip(real, kept)]
        proposer.add_kept(out.hidden_states, step_mask, order)
        if holes and should_compact(kv_mask.shape[1], real):
            kv_mask = compact(cache, kv_mask)

    proposer.remember(prompts, generated)  # the drafter's suffix index learns this call's outputs
    stats.new_tokens = sum(len(g) for g in generated)
    stats.seconds = time.perf_counter() - proposer.start_time
    if streamer is not None:
        streamer.end()
    if own_masks:  # the cache goes back to the user (return_dict) as transformers leaves it: not recording
        for layer in cache.layers:
            if hasattr(layer, "record_past"):
                layer.record_past = False
    longest = max(len(g) for g in generated)
    sequences = torch.cat([input_ids, torch.tensor([g + [pad] * (longest - len(g)) for g in generated], dtype=input_ids.dtype,
                                                   device=device)], dim=1)
    if not return_dict:
        return sequences
    return GenerateDecoderOnlyOutput(sequences=sequences, scores=_columns(row_scores, longest, pad) if want_scores else None,
                                     logits=_columns(row_raw, longest, pad) if want_logits else None,
                                     past_key_values=cache if rows == 1 else None)


def _columns(per_row: list[list[torch.Tensor]], length: int, pad: int) -> tuple:
    """Per-row lists of [V] -> a tuple of ``length`` [b, V]; a finished row's later columns put all mass on ``pad``
    (the token written there)."""
    template = next(t for row in per_row for t in row)
    filler = torch.full_like(template, float("-inf"))
    filler[pad] = 0.0
    return tuple(torch.stack([row[k] if k < len(row) else filler for row in per_row]) for k in range(length))


def _stream(streamer, generated, running: list[int], streamed: int, pad: int) -> int:
    """Put the columns every running row has reached ([b] tokens, ``pad`` for finished rows), as transformers' loop does;
    one prompt gets a step's tokens in one piece (a streamer of one row takes several tokens at once)."""
    if streamer is None:
        return streamed
    reached = min((len(generated[r]) for r in running), default=max(len(g) for g in generated))
    if len(generated) == 1 and reached > streamed:
        streamer.put(torch.tensor(generated[0][streamed:reached]))
        return reached
    for k in range(streamed, reached):
        streamer.put(torch.tensor([g[k] if k < len(g) else pad for g in generated]))
    return max(streamed, reached)


__all__ = ["speculative_decoding"]
