"""The decoding loop behind ``target.generate(**inputs, assistant_model=drafter)``: every mode, one loop.

A step, after the prefill (batch size 1):

    1. propose: a chain (the hybrid rule's choice: block draft, n-gram continuation, or nothing) or a tree
       (the block's top-K lattice plus the n-gram branch) -- a chain is a tree with one child per node
    2. verify: ONE target forward over [anchor] + nodes, each node at position past + depth
    3. accept: the target's choice after every node in one transfer, a walk from the root on the host
       (``accept_dflash2``): greedy argmax, or exact sampling
    4. commit: the accepted tokens and the bonus token; the cache keeps the accepted nodes only
       (tail-only work); their hidden states become the drafter's next context features

Two ways to verify, picked once per call:

* the target's own masks (a 2D padding mask): chains on dynamic caches; serves sliding windows, flash kernels
  and stateful targets (linear attention, rolled back exactly by ``rollback_dflash2``), the cache is cropped;
* an explicit 4D mask (``tree_dflash2.tree_attention_mask``, SDPA): trees, static caches and compiled calls;
  the accepted nodes' K/V move into place (``keep_cache_entries``). With ``torch.compile`` (transformers'
  rule: a static cache on an accelerator, or ``compile_config`` with ``_compile_all_devices``) every
  verification forward is padded to the next power of two (masked rows), so a handful of graphs (1, 2, 4, ...
  rows) serves the whole call, and a plain step does not pay for a full block (a CPU is compute-bound).
  On a static target cache the drafter's context K/V are preallocated as well, and when the target is compiled
  so is the drafter step (``DFlash2Proposer.preallocate``: its new context padded to a block, one graph).
"""

from __future__ import annotations

import time

import torch
from transformers.cache_utils import StaticLayer

from .accept_dflash2 import accept
from .attention_dflash2 import verification_attention
from .proposer_dflash2 import DFlash2Proposer
from .tree_dflash2 import (add_branch, keep_cache_entries, refuse_unsupported, root_tree, static_cache_length,
                           tree_attention_mask)


def refuse_unsupported_call(target, input_ids, generation_config, cache, budget: int) -> None:
    """What no mode serves, as clear errors before the first forward."""
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"speculative_decoding runs one row, got batch size {input_ids.shape[0]}: call target.generate(..., "
            f"assistant_model=drafter), which sends batches to batch_dflash2.batched_speculative_decoding"
        )
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


def padded_rows(nodes: int, largest: int) -> int:
    """Rows of a compiled verification forward over ``nodes`` nodes: the next power of two, at most ``largest``."""
    return min(1 << (nodes - 1).bit_length(), largest)


def fixed_verification_size(proposer: DFlash2Proposer, budget: int) -> int:
    """Rows of the largest verification forward of this call: the root and the largest proposal."""
    branch = proposer.ngram_tokens if proposer.ngram is not None else 0
    if budget:
        return 1 + budget + branch
    return 1 + max(proposer.config.block_size - 1, branch)


def reserve_verification_slots(cache, generation_config, rows: int) -> None:
    """Room for a padded verification at the very end: a static cache that ``generate`` made for this call and
    has not allocated yet gets ``rows`` slots beyond ``max_length`` (a user's cache keeps its size; steps that
    would not fit it run unpadded, eagerly)."""
    if getattr(cache, "_is_user_defined", False):
        return
    for layer in cache.layers:
        if type(layer) is StaticLayer and not layer.is_initialized:
            layer.max_cache_len = max(layer.max_cache_len, generation_config.max_length + rows)


def chain_tree(anchor: int, tokens: list[int]):
    return add_branch(root_tree(anchor), tokens)


@torch.no_grad()
def speculative_decoding(target, drafter, input_ids, logits_processor, stopping_criteria, generation_config, streamer=None,
                         budget: int = 0, **model_kwargs):
    """transformers' ``_assisted_decoding`` for a DFlash 2 drafter: same inputs, same outputs, every mode.

    ``budget``: tree nodes per step (0: one path per step)."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    cache = model_kwargs.get("past_key_values")
    refuse_unsupported_call(target, input_ids, generation_config, cache, budget)
    proposer = DFlash2Proposer(target, drafter, generation_config, logits_processor)
    proposer.stats.mode = f"tree-{budget}" if budget else "linear"
    rollback = proposer.rollback
    slots = static_cache_length(cache)  # None: a dynamic cache
    own_masks = budget == 0 and slots is None  # chains on a dynamic cache: the target's own (2D) masks, crop
    compiled = slots is not None and target._valid_auto_compile_criteria(model_kwargs, generation_config)
    rows = fixed_verification_size(proposer, budget) if compiled else None
    if compiled:
        reserve_verification_slots(cache, generation_config, rows)
        slots = static_cache_length(cache)
        compile_config = generation_config.compile_config or target._default_compile_config()  # what the target gets
        verify_compiled = target.get_compiled_call(compile_config)
    if slots is not None:  # the drafter's context K/V preallocated too; its step compiled with the target's forward
        proposer.preallocate(generation_config.max_length, compile_config if compiled else None)
    if own_masks:
        cache.activate_past_recording()  # sliding-window and linear-attention layers keep what a crop may need
    do_sample = bool(generation_config.do_sample)
    eos = getattr(generation_config, "_eos_token_tensor", None)
    eos = set() if eos is None else set(eos.view(-1).tolist())
    return_dict = generation_config.return_dict_in_generate
    scores = () if return_dict and generation_config.output_scores else None
    raw_logits = () if return_dict and generation_config.output_logits else None
    layers = [i + 1 for i in drafter.config.target_layer_ids]
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    device = input_ids.device

    # prefill: the prompt's features, the first token
    out = target(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True,
                 output_hidden_states=layers, logits_to_keep=1)
    proposer.pending_features.append(proposer.prompt_features(out.hidden_states, input_ids.shape[1]))
    raw = out.logits[:, -1].float()
    first = logits_processor(input_ids, raw.clone()) if len(logits_processor) else raw.clone()
    token = int(torch.multinomial(torch.softmax(first, -1), 1)) if do_sample else int(first.argmax())
    new = [token]
    history = input_ids[0].tolist()  # the sequence on the host, grown by the committed tokens (no per-step transfer)
    if scores is not None:
        scores += (first,)
    if raw_logits is not None:
        raw_logits += (raw,)
    while True:
        input_ids = torch.cat([input_ids, torch.tensor([new], dtype=input_ids.dtype, device=device)], dim=1)
        history += new
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((1, len(new)))], dim=1)
        if streamer is not None:
            streamer.put(torch.tensor(new))
        proposer.stats.new_tokens = input_ids.shape[1] - proposer.prompt_length
        if stopping_criteria(input_ids, scores).any():
            break
        room = generation_config.max_length - input_ids.shape[1]  # tokens this step may still add
        past = input_ids.shape[1] - 1  # the cache holds every committed token but the anchor (on the host: no sync)
        anchor = new[-1]
        if rollback is not None:  # every forward after the prefill needs full conv windows
            rollback.pad_conv_windows(cache)

        # 1. propose
        t0 = time.perf_counter()
        tree, path = root_tree(anchor), None
        space = None if slots is None else slots - past - 1  # nodes a static cache can still take
        if room > 1 and budget == 0:
            path = proposer.propose_path(input_ids, attention_mask, room - 1 if space is None else min(room - 1, space),
                                         history)
            tree = chain_tree(anchor, path.tokens)
        elif room > 1:
            tree = proposer.propose_tree(input_ids, attention_mask, anchor, budget, room - 1, space, history)
        proposer.stats.draft_seconds += time.perf_counter() - t0

        # 2. verify every node in one forward
        if rollback is not None and len(tree) > 1:
            rollback.begin_step(cache)
        depths = torch.tensor(tree.depths, device=device)
        n_rows = padded_rows(len(tree), rows) if compiled else len(tree)
        padded = compiled and past + n_rows <= slots  # a compiled graph per row count; else an eager forward
        if own_masks:
            out = target(input_ids=torch.tensor([tree.tokens], device=device), position_ids=(past + depths)[None],
                         attention_mask=torch.cat([attention_mask, attention_mask.new_ones((1, len(tree) - 1))], dim=1),
                         past_key_values=cache, use_cache=True, output_hidden_states=layers)
        else:
            n_rows = n_rows if padded else len(tree)
            tokens = tree.tokens + [anchor] * (n_rows - len(tree))  # padding rows: masked out, overwritten or dropped
            positions = past + torch.nn.functional.pad(depths, (0, n_rows - len(tree)))  # [n_rows]
            with verification_attention(target):
                out = (verify_compiled if padded else target)(
                    input_ids=torch.tensor([tokens], device=device), position_ids=positions[None],
                    attention_mask=tree_attention_mask(tree, attention_mask[0, :past], target.dtype, slots, n_rows),
                    past_key_values=cache, use_cache=True, output_hidden_states=layers)
        node_raw = out.logits[0, : len(tree)].float()  # [N, V]: the padding rows' logits go
        if padded:
            node_raw = node_raw.clone()  # a CUDA-graph replay reuses its output memory at the next step

        # 3. accept: the target's choice after every node, one transfer, a walk on the host
        log_q = None if path is None else path.log_q  # [L, V]: the chain's tokens were sampled from the drafter
        path_nodes, bonus, node_logits = accept(tree, node_raw, input_ids, logits_processor, do_sample, log_q)
        new = [tree.tokens[i] for i in path_nodes[1:]] + [bonus]
        new = new[: max(room, 1)]
        cut = next((k for k, t in enumerate(new) if t in eos), None)
        if cut is not None:
            new = new[: cut + 1]
        n_matches = len(new) - 1
        keep = path_nodes[: n_matches + 1]  # the root and the accepted nodes whose successors are committed

        # 4. commit: cache entries and drafter features of the kept nodes only
        if own_masks:
            cache.crop(-(len(tree) - len(keep)))  # also shrinks sliding-window / conv layers back to their size
            if rollback is not None:
                rollback.finish_step(accepted=len(keep), fed=len(tree))
                proposer.stats.rollback_seconds = rollback.seconds
        else:
            keep_cache_entries(cache, past, keep)
        proposer.pending_features.append(proposer.node_features(out.hidden_states, keep))
        proposer.record(n_matches, path, tree if budget else None)
        if scores is not None:
            scores += tuple(node_logits[i][None] for i in keep)
        if raw_logits is not None:
            raw_logits += tuple(node_raw[i][None] for i in keep)
    if streamer is not None:
        streamer.end()
    if own_masks:  # the cache goes back to the user (return_dict) as transformers leaves it: not recording
        for layer in cache.layers:
            if hasattr(layer, "record_past"):
                layer.record_past = False
    proposer.stats.seconds = time.perf_counter() - proposer.start_time
    if return_dict:
        return GenerateDecoderOnlyOutput(sequences=input_ids, scores=scores, logits=raw_logits, past_key_values=cache)
    return input_ids


__all__ = ["speculative_decoding"]
