"""The one decoding loop (loop_dflash2.py): static caches, torch.compile (inductor, on CPU), fixed verification shapes."""

import pytest
import torch

from conftest import root, tiny_drafter, tiny_target
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
        with pytest.raises(ValueError, match="use_cache=True"):
            target.generate(torch.tensor([[3, 5, 7], [4, 6, 8]]), assistant_model=drafter, max_new_tokens=4, pad_token_id=0,
                            use_cache=False)
    finally:
        handle.remove()
    assert not forwards
    stateful = tiny_glm5_next()
    glm_drafter = tiny_drafter(stateful, target_layer_ids=[0, 2, 4], target_hidden_reduction="mean", conv_group_size=8)
    with pytest.raises(ValueError, match="dynamic cache"):
        stateful.generate(torch.tensor([[3, 5, 7]]), assistant_model=glm_drafter, max_new_tokens=4, cache_implementation="static",
                          pad_token_id=0)


@pytest.mark.parametrize("compiled", [False, True])
def test_preallocated_drafter_step_equals_the_dynamic_one(compiled):
    """The drafter's context K/V in a preallocated cache (and its step compiled, new context padded to a block): the
    same block hiddens as the growing dynamic cache, step after step, for a batch of 2 rows with holes (a row keeps
    fewer than the step wrote), 1..B and more new context tokens per step (more than a block runs eagerly), a
    sliding-window layer (its window counts positions, not slots) and an odd block; the compiled step is ONE graph."""
    from transformers import GenerationConfig

    from dflash2_tools.benchmark import compile_on_any_device

    target = tiny_target("llama")
    drafter = tiny_drafter(target, block_size=5, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                           sliding_window=9)
    proposer_module = root.proposer_of(drafter)
    config = GenerationConfig(do_sample=False, max_length=64, pad_token_id=0)
    prompts = [[3, 4, 5], [6, 7]]
    dynamic = proposer_module.Proposer(target, drafter, config, prompts)
    static = proposer_module.Proposer(target, drafter, config, prompts)
    static.preallocate(64, compile_on_any_device() if compiled else None)
    torch._dynamo.reset()
    before = graphs_compiled()
    width = drafter.fc.in_features
    g = torch.Generator().manual_seed(0)
    anchors = torch.tensor([5, 7])
    for step, n_new in enumerate((3, 1, 4, 5, 2, 7, 3, 1)):  # a prompt shorter than a block (its first call is compiled),
        features = torch.randn(2, n_new, width, generator=g)  # then what steps commit (7 > a block: eager)
        mask = torch.ones(2, n_new, dtype=torch.long)
        if step == 0:
            mask[1, 0] = 0  # the shorter prompt is left-padded
        elif n_new > 1:
            mask[1, n_new // 2 :] = 0  # row 1 kept fewer: holes
        dynamic.pending, static.pending = [(features, mask)], [(features, mask)]
        with torch.no_grad():  # as in generate
            expected = dynamic.draft_hidden(anchors)
            got = static.draft_hidden(anchors)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
        assert static.real == dynamic.real
    if compiled:
        assert graphs_compiled() - before == 1  # one graph for every step of up to a block of new context


def test_holes_do_not_move_a_sliding_drafter_window():
    """A row with holes in the drafter's context drafts what it drafts without them: its keys carry positions."""
    from transformers import GenerationConfig

    target = tiny_target("llama")
    drafter = tiny_drafter(target, block_size=5, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                           sliding_window=4)
    proposer_module = root.proposer_of(drafter)
    config = GenerationConfig(do_sample=False, max_length=64, pad_token_id=0)
    width = drafter.fc.in_features
    features = torch.randn(1, 9, width, generator=torch.Generator().manual_seed(1))
    holed = proposer_module.Proposer(target, drafter, config, [[1]])
    plain = proposer_module.Proposer(target, drafter, config, [[1]])
    holed.pending = [(torch.cat([features[:, :4], torch.zeros(1, 3, width), features[:, 4:]], 1),
                      torch.tensor([[1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1]]))]  # 3 holes in the middle
    plain.pending = [(features, torch.ones(1, 9, dtype=torch.long))]
    with torch.no_grad():
        torch.testing.assert_close(holed.draft_hidden(torch.tensor([5])), plain.draft_hidden(torch.tensor([5])), atol=2e-5, rtol=1e-4)


def test_a_compiled_batch_of_four_equals_the_targets_batched_generate(accepting, gen_module):
    """Static cache + inductor at batch 4: mixed prompt lengths and an EOS that ends rows at different steps (finished
    rows stay in the batch as dead rows: no shape changes), greedy-equal to the target's own batched eager generate;
    a bounded number of graphs, and a second call whose rows finish in another order compiles nothing."""
    target, drafter, prompts = accepting
    lengths, width = [3, 9, 5, 7], 9

    def batch(order):
        rows = [prompts[i % len(prompts)][:n] for i, n in zip(order, lengths)]
        ids = torch.tensor([[0] * (width - len(p)) + p for p in rows])  # [4, 9] left-padded
        mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in rows])[:, None]).long()  # [4, 9]
        return ids, mask

    kw = dict(do_sample=False, max_new_tokens=40, pad_token_id=0)
    ids, mask = batch([0, 1, 2, 3])
    free = target.generate(input_ids=ids, attention_mask=mask, eos_token_id=None, **kw)
    eos = int(free[:, width + 6 :].flatten().mode().values)  # a token some rows emit mid-way
    torch._dynamo.reset()
    before = graphs_compiled()
    ends = []
    for order in ([0, 1, 2, 3], [3, 2, 1, 0]):  # the second call: other rows, other finishing order, same shapes
        ids, mask = batch(order)
        expected = target.generate(input_ids=ids, attention_mask=mask, eos_token_id=eos, **kw)
        out, stats = gen_module.dflash2_generate(target, drafter, ids, attention_mask=mask, eos_token_id=eos,
                                                 cache_implementation="static", compile_config=compile_on_any_device(), **kw)
        assert torch.equal(out, expected), order
        assert stats.accepted > 0, stats.as_dict()  # multi-token steps went through the graphs
        ends.append([int(((row[width:] == eos).nonzero()[:1].flatten().tolist() or [-1])[0]) for row in expected])
        if len(ends) == 1:
            first_call = graphs_compiled() - before
    assert len(set(ends[0])) > 1 and ends[0] != ends[1]  # rows finished at different steps, and in another order
    assert 1 <= first_call <= 8, first_call  # a graph per row bucket and the drafter's step, not per step
    assert graphs_compiled() - before == first_call  # the second call compiled nothing
