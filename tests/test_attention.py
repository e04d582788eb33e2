"""Verification attention (attention_dflash2.py): packed GQA heads give transformers' SDPA numbers without copying
the cache per layer, and a target verifies a tree through it exactly as through its own attention."""

from __future__ import annotations

import pytest
import torch
from conftest import root, tiny_target
from transformers.integrations.sdpa_attention import sdpa_attention_forward


def attention_module():
    return root.attention()


class _Layer(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (6, 3), (4, 4)])
@pytest.mark.parametrize("mask_kind", ["float", "bool"])
def test_packed_heads_equal_transformers_sdpa(heads, kv_heads, mask_kind):
    g = torch.Generator().manual_seed(0)
    b, q, k, d = 2, 5, 13, 10
    query = torch.randn(b, heads, q, d, generator=g)
    key, value = torch.randn(b, kv_heads, k, d, generator=g), torch.randn(b, kv_heads, k, d, generator=g)
    allowed = torch.rand(b, 1, q, k, generator=g) > 0.4
    allowed[..., 0] = True  # no query fully masked
    mask = allowed if mask_kind == "bool" else torch.zeros(b, 1, q, k).masked_fill(~allowed, torch.finfo(torch.float32).min)
    layer = _Layer(heads // kv_heads)
    ours, _ = attention_module().packed_gqa_sdpa(layer, query, key, value, mask, scaling=0.3)
    ref, _ = sdpa_attention_forward(layer, query, key, value, mask, scaling=0.3)
    assert ours.shape == ref.shape == (b, q, heads, d)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_a_masked_gqa_verification_does_not_copy_the_cache(monkeypatch):
    """transformers' path repeats K/V for a masked multi-query forward; the packed one must not."""
    import transformers.integrations.sdpa_attention as sdpa

    calls = []
    real = sdpa.repeat_kv
    monkeypatch.setattr(sdpa, "repeat_kv", lambda x, n: calls.append(x.shape) or real(x, n))
    layer = _Layer(3)
    query, key, value = torch.randn(1, 6, 4, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    mask = torch.ones(1, 1, 4, 9, dtype=torch.bool)
    attention_module().packed_gqa_sdpa(layer, query, key, value, mask)
    assert not calls
    sdpa_attention_forward(layer, query, key, value, mask)
    assert calls  # the control: transformers' own function does copy here


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_tree_forward_through_packed_heads_equals_the_targets_own(arch):
    tree_module = root.tree()
    target = tiny_target(arch)
    assert target.config._attn_implementation == "sdpa"
    g = torch.Generator().manual_seed(1)
    context = torch.randint(0, target.config.vocab_size, (1, 11), generator=g)
    tree = tree_module.add_branch(tree_module.add_branch(tree_module.root_tree(3), [4, 5, 6]), [7, 8])
    mask = tree_module.tree_attention_mask(tree, torch.ones(11, dtype=torch.long), target.dtype)
    outputs = []
    for packed in (False, True):
        cache = target(input_ids=context, use_cache=True).past_key_values
        kwargs = dict(input_ids=torch.tensor([tree.tokens]), position_ids=(11 + torch.tensor(tree.depths))[None],
                      attention_mask=mask, past_key_values=cache, use_cache=True)
        if packed:
            with root.attention().verification_attention(target):
                assert target.config._attn_implementation == attention_module().PACKED_SDPA
                outputs.append(target(**kwargs).logits)
        else:
            outputs.append(target(**kwargs).logits)
    assert target.config._attn_implementation == "sdpa"  # switched back
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-5)
