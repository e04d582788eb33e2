"""The one decoding loop (loop_dflash2.py): static caches, torch.compile (inductor, on CPU), fixed verification shapes."""

import pytest
import torch

from conftest import tiny_drafter, tiny_target
from dflash2_tools.benchmark import compile_on_any_device


def graphs_compiled() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("budget", [None, 6])
def test_compiled_static_cache_equals_eager_and_compiles_once_per_call_shape(accepting, gen_module, budget, monkeypatch):
    """Static cache + inductor through the public call: greedy output equal to the target's own eager greedy output over
    128 tokens; verification forwards padded to a few row buckets, so the compiled graphs do not grow with the steps, and
    the same call again compiles nothing."""
    target, drafter, prompts = accepting
    monkeypatch.setattr(drafter.config, "tree_budget", budget)
    ids = torch.tensor([prompts[1][:6]])
    kw = dict(do_sample=False, max_new_tokens=128, min_new_tokens=128, eos_token_id=None, pad_token_id=0)
    expected = target.generate(ids, **kw)
    torch._dynamo.reset()
    before = graphs_compiled()
    out, stats = gen_module.dflash2_generate(target, drafter, ids, cache_implementation="static",
                                             compile_config=compile_on_any_device(), **kw)
    first_call = graphs_compiled() - before
    assert torch.equal(out, expected)
    assert stats.mean_acceptance_length > 1.5, stats.as_dict()  # real multi-token steps went through the graph
    assert 1 <= first_call <= 6, first_call  # a graph per row bucket (1, 2, 4, 8 rows; or one dynamic graph), not per step
    again, _ = gen_module.dflash2_generate(target, drafter, ids, cache_implementation="static",
                                           compile_config=compile_on_any_device(), **kw)
    assert torch.equal(again, expected)
    assert graphs_compiled() - before == first_call  # no recompilation


def test_static_cache_without_compile_pads_nothing_and_stays_exact(gen_module):
    """Eager static caches (a CPU's default: transformers does not compile there) verify unpadded: exact on a target with
    odd sizes, in both modes, with max_new_tokens running into the cache's end."""
    target = tiny_target("qwen3")
    ids = torch.tensor([[4, 8, 15, 16, 23]])
    kw = dict(do_sample=False, max_new_tokens=23, eos_token_id=None, pad_token_id=0)
    expected = target.generate(ids, **kw)
    for budget in (None, 5):
        drafter = tiny_drafter(target, block_size=7, tree_budget=budget)
        out, stats = gen_module.dflash2_generate(target, drafter, ids, cache_implementation="static", **kw)
        assert torch.equal(out, expected), budget
        assert stats.mode == ("tree-5" if budget else "linear")


def test_what_no_mode_serves_is_refused_before_any_forward(gen_module):
    """The loop's refusals name the fix and come before the target runs (a forward counter stays at zero)."""
    from dflash2_tools.tiny_targets import tiny_glm5_next

    target = tiny_target("llama")
    drafter = tiny_drafter(target, tree_budget=None)
    forwards = []
    handle = target.register_forward_pre_hook(lambda *a: forwards.append(1))
    try:
        with pytest.raises(ValueError, match="output_attentions/output_hidden_states"):
            target.generate(torch.tensor([[3, 5, 7]]), assistant_model=drafter, max_new_tokens=4, return_dict_in_generate=True,
                            output_hidden_states=True, pad_token_id=0)
        with pytest.raises(ValueError, match="cache_implementation=None"):  # a batch on a static cache
            target.generate(torch.tensor([[3, 5, 7], [4, 6, 8]]), assistant_model=drafter, max_new_tokens=4, pad_token_id=0,
                            cache_implementation="static")
    finally:
        handle.remove()
    assert not forwards
    stateful = tiny_glm5_next()
    glm_drafter = tiny_drafter(stateful, target_layer_ids=[0, 2, 4], target_hidden_reduction="mean", conv_group_size=8)
    with pytest.raises(ValueError, match="dynamic cache"):
        stateful.generate(torch.tensor([[3, 5, 7]]), assistant_model=glm_drafter, max_new_tokens=4, cache_implementation="static",
                          pad_token_id=0)
