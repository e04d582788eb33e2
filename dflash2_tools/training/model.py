"""Stage 2, model: the drafter to train, sized from the target and optionally initialised from it.

Three starts: a checkpoint being resumed, a warm start from a drafter folder (``--init-from``),
or a fresh drafter sized from the target. A fresh drafter gets a draft vocabulary from the
training responses (``--draft-vocab``) and, with ``--init-from-target``, the target's own last
layers as its layers (the shapes match when the drafter keeps the target's width, heads and
MLP size) and ``fc`` set to pass the deepest tapped layer through.
"""

from __future__ import annotations

import torch

from .. import drafter as root
from ..draft_vocab import most_frequent_ids


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


def draft_vocab_from(train, vocab_size: int, size: int, eos_token_id) -> list[int] | None:
    """The ``size`` most frequent response token ids of the training sequences (+ EOS); None if size is 0
    or covers the whole vocabulary."""
    if not size or size >= vocab_size:
        return None
    import numpy as np

    counts = np.zeros(vocab_size, dtype=np.int64)
    for tokens, prompt_len in train:
        np.add.at(counts, np.asarray(tokens[prompt_len:], dtype=np.int64), 1)
    eos = eos_token_id if isinstance(eos_token_id, list) else [eos_token_id]
    return most_frequent_ids(counts, size, [i for i in eos if i is not None])


# drafter layer module -> target layer module, for the tensors whose shapes the two share
_LAYER_PARTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")


@torch.no_grad()
def init_from_target(drafter, target) -> list[int]:
    """Copy the target's LAST ``num_hidden_layers`` layers (and final norm) into the drafter; set ``fc``
    to pass the deepest tapped layer's features. Returns the target layer ids copied.

    Why the last layers: the drafter's context keys/values come from deep target features, which is
    what the target's own top layers read; the deepest tapped layer through ``fc`` gives the fused
    context the scale those layers expect. Raises a clear error when the shapes differ.
    """
    cfg = drafter.config
    decoder = target.get_decoder()
    target_layers = decoder.layers
    copied = list(range(len(target_layers) - cfg.num_hidden_layers, len(target_layers)))
    for layer, source_idx in zip(drafter.layers, copied):
        for part in _LAYER_PARTS:
            mine, theirs = layer.get_submodule(part), target_layers[source_idx].get_submodule(part)
            for name, param in mine.named_parameters(recurse=False):
                source = getattr(theirs, name, None)
                if source is None or source.shape != param.shape:
                    raise ValueError(
                        f"--init-from-target: drafter {part}.{name} {tuple(param.shape)} does not match target layer "
                        f"{source_idx} ({None if source is None else tuple(source.shape)}); keep the target's sizes "
                        f"(no --heads/--kv-heads/--intermediate-size) or drop --init-from-target")
                param.copy_(source)
    if hasattr(decoder, "norm") and decoder.norm.weight.shape == drafter.norm.weight.shape:
        drafter.norm.weight.copy_(decoder.norm.weight)
    H = cfg.hidden_size
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, -H:] = torch.eye(H)  # [H, n*H]: the last (deepest) tapped layer passes through
    return copied


def make_drafter(target, args, train):
    """(drafter fp32, trainer state | None, step, tokens seen) for this run."""
    ckpt = args.checkpoint
    if ckpt.exists():
        drafter = root.load_drafter(ckpt, dtype=torch.float32)
        state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
        return drafter, state, state["step"], state["tokens_seen"]
    if args.init_from:  # warm start (e.g. from the shipped bf16 weights): same architecture, fresh optimizer
        return root.load_drafter(args.init_from, dtype=torch.float32), None, 0, 0
    config = build_drafter_config(target, args)
    config.draft_vocab_ids = draft_vocab_from(train, config.vocab_size, args.draft_vocab, config.eos_token_id)
    drafter = root.model_class()._from_config(config, dtype=torch.float32)
    if args.init_from_target:
        init_from_target(drafter, target)
    return drafter, None, 0, 0
