"""The drafter model: shapes, conv semantics, selector, attention backends, save/load, official schema, config errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import HIDDEN, VOCAB, root, tiny_drafter, tiny_drafter_config, tiny_target
from dflash2_tools.training.forward import multi_block_training_mask

# Config and tensor schema of a public DFlash 2 checkpoint (copied from the project's shared reference).
SHARED = Path(__file__).resolve().parent / "fixtures"


def _inputs(b=2, blocks=1, block=5, ctx=9, n_ctx_layers=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(b, blocks * block, HIDDEN, generator=g)
    feats = torch.randn(b, ctx, n_ctx_layers * HIDDEN, generator=g)
    return noise, feats


def test_forward_shapes_and_logits():
    d = tiny_drafter()
    noise, feats = _inputs()
    out = d(noise_embeds=noise, context_hidden_states=feats)
    assert out.last_hidden_state.shape == (2, 5, HIDDEN)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    assert d.draft_logits(head, out.last_hidden_state).shape == (2, 5, VOCAB)


@pytest.mark.parametrize("bias", [False, True])
def test_draft_logits_equal_the_heads_own_forward_on_block_slices(bias):
    """The head product draft_logits uses (weight-major, over flattened rows) equals the head's own
    forward, values and gradients, on the non-contiguous slices training and generation pass."""
    d = tiny_drafter(final_logit_softcapping=None)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=bias)
    x = torch.randn(2, 3, 5, HIDDEN, requires_grad=True)
    for h in (x[:, :, 1:], x[0, :, 1:4], x[0, :, 2]):  # [b, n, B-1, H], [n, 3, H], [n, H] views
        assert not h.is_contiguous()
        got, ref = d.draft_logits(head, h), head(h)
        torch.testing.assert_close(got, ref)
        (g_got,) = torch.autograd.grad(got.square().sum(), x)
        (g_ref,) = torch.autograd.grad(ref.square().sum(), x)
        torch.testing.assert_close(g_got, g_ref)


def test_context_cache_equals_full_context():
    """Feeding the context in two pieces through the cache equals feeding it at once."""
    d = tiny_drafter()
    noise, feats = _inputs(b=1)
    full = d(noise_embeds=noise, context_hidden_states=feats).last_hidden_state
    from transformers import DynamicCache

    cache = DynamicCache()
    d(noise_embeds=noise, context_hidden_states=feats[:, :4], past_key_values=cache, position_ids=torch.arange(9)[None])
    cache.crop(-5)
    pos = torch.arange(4, 4 + 5 + 5)[None]
    split = d(noise_embeds=noise, context_hidden_states=feats[:, 4:], past_key_values=cache, position_ids=pos).last_hidden_state
    torch.testing.assert_close(split, full, rtol=1e-5, atol=1e-5)
    assert cache.get_seq_length() == 9 + 5


def test_identity_conv_equals_plain_layer():
    """With identity-initialised convs a DFlash 2 layer computes exactly what a plain DFlash layer does."""
    torch.manual_seed(0)
    with_conv = tiny_drafter(randomize=False)
    plain = root.model_class()._from_config(tiny_drafter_config(conv_kernel_size=None, conv_group_size=None), attn_implementation="sdpa").eval()
    missing, unexpected = plain.load_state_dict(with_conv.state_dict(), strict=False)
    assert not missing and all("conv" in k for k in unexpected) and unexpected
    noise, feats = _inputs()
    a = with_conv(noise_embeds=noise, context_hidden_states=feats).last_hidden_state
    b = plain(noise_embeds=noise, context_hidden_states=feats).last_hidden_state
    assert torch.equal(a, b)


def test_conv_identity_init_values():
    d = tiny_drafter(randomize=False)
    conv = d.layers[0].attention_conv
    assert torch.equal(conv.base_kernel[:, 0], torch.ones_like(conv.base_kernel[:, 0]))
    assert torch.equal(conv.base_kernel[:, 1], torch.zeros_like(conv.base_kernel[:, 1]))
    assert torch.count_nonzero(conv.kernel_projection.weight) == 0


def _random_conv(modeling):
    cfg = tiny_drafter_config()
    conv = modeling.DFlash2DynamicConv(cfg, 0)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    return conv


def test_conv_is_two_tap_and_block_local(modeling_module):
    """Output at block position t depends only on positions t and t-1 of the input; position 0 never sees the
    previous block."""
    conv = _random_conv(modeling_module)
    B, blocks = 5, 3
    h = torch.randn(1, B * blocks, HIDDEN)
    v = torch.randn(1, B * blocks, HIDDEN, requires_grad=True)
    kernel, _ = conv.kernels(h)
    for t in range(B * blocks):
        out = conv.apply(v, kernel, B)[0, t].sum()
        (grad,) = torch.autograd.grad(out, v)
        touched = set(torch.nonzero(grad[0].abs().sum(-1)).flatten().tolist())
        expected = {t} if t % B == 0 else {t, t - 1}
        assert touched == expected, (t, touched)


def test_conv_matches_equation(modeling_module):
    conv = _random_conv(modeling_module)
    B = 5
    h = torch.randn(2, B, HIDDEN)
    v = torch.randn(2, B, HIDDEN)
    prepare, finish = conv.kernels(h)
    out = conv.apply(v, finish, B)
    g = conv.group_size
    dyn = conv.kernel_projection(h).view(2, B, 2, 2, HIDDEN // g)
    for t in range(B):
        for c in (0, 17, HIDDEN - 1):
            k0 = conv.base_kernel[1, 0, c] + dyn[:, t, 1, 0, c // g]
            k1 = conv.base_kernel[1, 1, c] + dyn[:, t, 1, 1, c // g]
            ref = k0 * v[:, t, c] + (k1 * v[:, t - 1, c] if t > 0 else 0)
            torch.testing.assert_close(out[:, t, c], ref, rtol=1e-5, atol=1e-5)


def _two_block_forward(d, noise, feats):
    """Blocks anchored at positions 3 and 6 of a 9-token context, in one multi-block forward."""
    anchors = torch.tensor([[3, 6]])
    mask = multi_block_training_mask(anchors, 5, 9)
    pos = torch.cat([torch.arange(9)[None], (anchors[:, :, None] + torch.arange(5)).view(1, -1)], 1)
    return d(noise_embeds=noise, context_hidden_states=feats, position_ids=pos, attention_mask=mask).last_hidden_state


def test_block_reset_in_full_model():
    """In a multi-block forward, changing block 0 never changes block 1 (mask + conv reset)."""
    d = tiny_drafter()
    noise, feats = _inputs(b=1, blocks=2)
    a = _two_block_forward(d, noise, feats)
    noise2 = noise.clone()
    noise2[:, :5] += 1.0
    b = _two_block_forward(d, noise2, feats)
    torch.testing.assert_close(a[:, 5:], b[:, 5:])
    assert not torch.allclose(a[:, :5], b[:, :5])


def test_multi_block_equals_single_block_inference():
    """A block trained inside a multi-block forward gets exactly the hidden it gets alone at inference."""
    d = tiny_drafter()
    noise, feats = _inputs(b=1, blocks=2)
    multi = _two_block_forward(d, noise, feats)
    single = d(noise_embeds=noise[:, 5:], context_hidden_states=feats[:, :6], position_ids=torch.arange(6 + 5)[None]).last_hidden_state
    torch.testing.assert_close(multi[:, 5:], single, rtol=1e-5, atol=1e-5)


def _brute_force_walk(selector, hidden, logits, anchor):
    K = selector.top_k
    vals, ids = logits.topk(K, -1)
    g = selector.hidden_projection(hidden)
    prev, out = anchor, []
    for t in range(logits.shape[0]):
        best, best_tok = None, None
        for j in range(K):
            s = vals[t, j] + (selector.predecessor_codebook[prev] * g[t] * selector.successor_codebook[ids[t, j]]).sum()
            if best is None or s > best:
                best, best_tok = s, int(ids[t, j])
        out.append(best_tok)
        prev = best_tok
    return out


def test_selector_walk_matches_brute_force():
    d = tiny_drafter()
    sel = d.candidate_selector
    with torch.no_grad():
        sel.predecessor_codebook.normal_()
        sel.successor_codebook.normal_()
        sel.hidden_projection.weight.normal_()
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        hidden = torch.randn(2, 4, HIDDEN, generator=g)
        logits = torch.randn(2, 4, VOCAB, generator=g)
        anchor = torch.randint(0, VOCAB, (2,), generator=g)
        walk = sel.walk(hidden, logits, anchor)
        for i in range(2):
            assert walk.tokens[i].tolist() == _brute_force_walk(sel, hidden[i], logits[i], int(anchor[i]))
        # the selector really re-ranks: it is not always the argmax
    assert walk.tokens.shape == (2, 4)


def test_selector_q_rows_are_distributions():
    d = tiny_drafter()
    sel = d.candidate_selector
    hidden = torch.randn(1, 4, HIDDEN)
    logits = torch.randn(1, 4, VOCAB)
    walk = sel.walk(hidden, logits, torch.tensor([3]), temperature=0.7, generator=torch.Generator().manual_seed(0))
    q = walk.log_q.exp()
    torch.testing.assert_close(q.sum(-1), torch.ones(1, 4))
    assert (q >= 0).all()
    full = walk.full_vocab_logits(VOCAB).softmax(-1)
    torch.testing.assert_close(full.sum(-1), torch.ones(1, 4))
    outside = torch.ones(1, 4, VOCAB, dtype=torch.bool).scatter(-1, walk.candidates, False)
    assert (full[outside] == 0).all()
    # every chosen token is one of its position's candidates
    assert (walk.candidates == walk.tokens[..., None]).any(-1).all()


def test_draft_vocabulary_head_and_walk_equal_the_full_ones_restricted():
    """Sub-vocabulary logits are the full head's columns (transforms included); the walk over them
    equals the walk over full logits with every other token masked out."""
    vocab = list(range(3, VOCAB, 4)) + [0]  # unsorted, odd size
    d = tiny_drafter(draft_vocab_ids=vocab, final_logit_softcapping=3.0)
    with torch.no_grad():
        d.candidate_selector.successor_codebook.normal_()
        d.candidate_selector.predecessor_codebook.normal_()
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=True)
    sub = d.draft_head(head)
    ids = torch.tensor(vocab)
    h = torch.randn(2, 4, HIDDEN)
    full = d.draft_logits(head, h)
    torch.testing.assert_close(d.draft_logits(sub, h), full[..., ids])
    masked = torch.full_like(full, float("-inf")).index_copy(-1, ids, full[..., ids])
    anchor = torch.tensor([5, 9])
    for t in (0.0, 0.8):
        a = d.candidate_selector.walk(h, d.draft_logits(sub, h), anchor, t, torch.Generator().manual_seed(1), vocab_ids=sub.vocab_ids)
        b = d.candidate_selector.walk(h, masked, anchor, t, torch.Generator().manual_seed(1))
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.candidates, b.candidates)
        torch.testing.assert_close(a.log_q, b.log_q)
    assert d.draft_head(head) is not head and tiny_drafter().draft_head(head) is head
    assert d.draft_head(head) is sub  # copied once per head
    with torch.no_grad():
        head.weight.mul_(2.0)  # a head that changed (training) gets a fresh copy of its rows
    torch.testing.assert_close(d.draft_logits(d.draft_head(head), h), d.draft_logits(head, h)[..., ids])
    d.config.draft_vocab_ids = vocab[:-1]  # so does another id list
    assert d.draft_head(head).weight.shape[0] == len(vocab) - 1


def test_eager_and_sdpa_agree():
    e = tiny_drafter(attn_implementation="eager")
    s = tiny_drafter(attn_implementation="sdpa")
    noise, feats = _inputs()
    torch.testing.assert_close(
        e(noise_embeds=noise, context_hidden_states=feats).last_hidden_state,
        s(noise_embeds=noise, context_hidden_states=feats).last_hidden_state,
        rtol=1e-5,
        atol=1e-5,
    )
    # with a sliding window that actually masks
    e = tiny_drafter(attn_implementation="eager", use_sliding_window=True, sliding_window=4)
    s = tiny_drafter(attn_implementation="sdpa", use_sliding_window=True, sliding_window=4)
    torch.testing.assert_close(
        e(noise_embeds=noise, context_hidden_states=feats).last_hidden_state,
        s(noise_embeds=noise, context_hidden_states=feats).last_hidden_state,
        rtol=1e-5,
        atol=1e-5,
    )


def test_sliding_window_limits_context():
    d = tiny_drafter(use_sliding_window=True, sliding_window=4)
    noise, feats = _inputs(b=1)
    a = d(noise_embeds=noise, context_hidden_states=feats).last_hidden_state
    feats2 = feats.clone()
    feats2[:, 0] += 5.0  # position 0 is more than 4 tokens before every block query (positions 9..13)
    b = d(noise_embeds=noise, context_hidden_states=feats2).last_hidden_state
    torch.testing.assert_close(a, b)
    feats3 = feats.clone()
    feats3[:, -1] += 5.0
    assert not torch.allclose(a, d(noise_embeds=noise, context_hidden_states=feats3).last_hidden_state)


def test_save_and_load_with_auto_model(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModel

    d = tiny_drafter()
    d.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert cfg["auto_map"]["AutoModel"] == "modeling_dflash2.DFlash2DraftModel"
    assert cfg["auto_map"]["AutoConfig"] == "configuration_dflash2.DFlash2Config"
    for key in ("target_layer_ids", "block_size", "mask_token_id"):
        assert cfg[key] == cfg["dflash_config"][key]
    assert cfg["dflash_config"]["selector_top_k"] == 7 and cfg["dflash_config"]["conv_group_size"] == 16
    for name in root.REMOTE_CODE_FILES:  # the n-gram, stats and rollback modules come along through relative imports
        assert (tmp_path / name).is_file(), f"{name} not copied next to the weights"
    loaded = AutoModel.from_pretrained(tmp_path, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(loaded).__name__ == "DFlash2DraftModel"
    assert AutoConfig.from_pretrained(tmp_path, trust_remote_code=True).block_size == 5
    noise, feats = _inputs()
    torch.testing.assert_close(
        loaded(noise_embeds=noise, context_hidden_states=feats).last_hidden_state,
        d(noise_embeds=noise, context_hidden_states=feats).last_hidden_state,
        rtol=0,
        atol=0,
    )


def test_official_schema_loads_without_missing_or_unexpected_keys(tmp_path):
    """An official-format config (model_type qwen3, nested dflash_config) with shrunk random tensors loads cleanly."""
    from safetensors.torch import save_file

    official = json.loads((SHARED / "official-dflash2-config.json").read_text())
    tensors = json.loads((SHARED / "official-dflash2-tensors.json").read_text())
    shrink = {6656: 64, 33280: 5 * 64, 19968: 96, 4096: 4 * 16, 1024: 2 * 16, 1664: 2 * 2 * 64 // 16, 128: 16, 202048: 301}
    cfg = dict(official, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=301)
    cfg["dflash_config"] = dict(official["dflash_config"], mask_token_id=300, selector_rank=256)
    cfg.pop("bos_token_id"), cfg.pop("eos_token_id"), cfg.pop("pad_token_id")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    state = {name: torch.randn([shrink.get(s, s) for s in spec["shape"]]) for name, spec in tensors.items()}
    save_file(state, tmp_path / "model.safetensors")

    C = root.config_class()
    config = C.from_pretrained(tmp_path)
    assert config.target_layer_ids == [1, 13, 25, 37, 49] and config.block_size == 16 and config.sliding_window == 2048
    assert config.output_multiplier == pytest.approx(0.19611613513818404) and config.final_logit_softcapping == 20.0
    model = root.model_class()(config)
    ours = {k: list(v.shape) for k, v in model.state_dict().items()}
    theirs = {k: list(v.shape) for k, v in state.items()}
    assert ours == theirs
    result = model.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys


def test_our_checkpoint_uses_official_names(tmp_path):
    """Our saved tensor names are exactly the official ones (no embed / lm_head, codebooks without .weight)."""
    from safetensors import safe_open

    tensors = json.loads((SHARED / "official-dflash2-tensors.json").read_text())
    d = tiny_drafter(num_hidden_layers=5, target_layer_ids=[0, 1, 2, 3, 5], num_target_layers=7)
    d.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert names == set(tensors)


def test_logit_transforms():
    d = tiny_drafter(output_multiplier=0.5, final_logit_softcapping=3.0, input_embedding_scale=2.0)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    h = torch.randn(1, 3, HIDDEN) * 10
    ref = 3.0 * torch.tanh(head(h) * 0.5 / 3.0)
    torch.testing.assert_close(d.draft_logits(head, h), ref)
    emb = torch.nn.Embedding(VOCAB, HIDDEN)
    ids = torch.tensor([[1, 2]])
    torch.testing.assert_close(d.embed_block(emb, ids), emb(ids) * 2.0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(conv_group_size=7), "divisible by conv_group_size"),
        (dict(conv_group_size=None), "go together"),
        (dict(selector_top_k=None), "go together"),
        (dict(block_size=1), "block_size must be at least 2"),
        (dict(target_layer_ids=[0, 9]), "out of range"),
        (dict(mask_token_id=VOCAB), "outside the vocabulary"),
        (dict(num_key_value_heads=4), "multiple of num_key_value_heads"),
        (dict(selector_top_k=VOCAB + 1), "selector_top_k"),
        (dict(use_sliding_window=True, sliding_window=0), "sliding_window"),
        (dict(target_hidden_reduction="max"), "target_hidden_reduction"),
        (dict(dflash_config={"blocksize": 8}), "unknown keys"),
        (dict(draft_vocab_ids=[1, 2, 2, 3, 4, 5, 6, 7]), "draft_vocab_ids must be distinct"),
        (dict(draft_vocab_ids=list(range(7)) + [VOCAB]), "draft_vocab_ids must be distinct"),
        (dict(draft_vocab_ids=[1, 2, 3]), "fewer than selector_top_k"),
        (dict(hybrid_ngram={"num_token": 3}), "hybrid_ngram has unknown keys"),
        (dict(hybrid_ngram={"min_n": 3, "max_n": 2}), "1 <= min_n <= max_n"),
        (dict(tree_budget=-1), "tree_budget must be"),
        (dict(tree_budget=2.5), "tree_budget must be"),
        (dict(tree_budget=True), "tree_budget must be"),
        (dict(tree_budget="big"), "tree_budget must be"),
    ],
)
def test_config_validation_errors(overrides, message):
    with pytest.raises(Exception, match=message):
        tiny_drafter_config(**overrides)


def test_default_target_layer_ids():
    f = root.config_module().default_target_layer_ids
    assert f(36, 5) == [1, 9, 17, 25, 33]
    assert f(30, 4) == [1, 10, 18, 27]


def test_tools_read_stats_from_a_drafter_folders_own_code(tmp_path, monkeypatch):
    """A drafter loaded from another folder runs that folder's generation code; the tools must read ITS stats."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel

    target = tiny_target()
    tiny_drafter(target).save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path, trust_remote_code=True, dtype=torch.float32).eval()
    gen = root.generation_of(loaded)
    assert gen is not root.generation()  # a different dynamic package: the root collector would stay empty
    _, stats = gen.dflash2_generate(target, loaded, input_ids=torch.tensor([[3, 5, 7, 11]]), do_sample=False, max_new_tokens=12)
    assert stats.accept_lengths and stats.mean_acceptance_length >= 1.0
