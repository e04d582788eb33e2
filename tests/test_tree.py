"""Tree verification (tree_dflash2.py): construction, mask, cache compaction, exact greedy and sampling."""

from __future__ import annotations

import pytest
import torch
from conftest import FREE_COSTS, VOCAB, pretend_transformers_version, root, tiny_drafter, tiny_target
from test_sampling import N_NEW, SAMPLES, _processors, chi_square_p_value, exact_joint
from test_sampling import setup  # noqa: F401  (fixture: the sampling tests' flat target and far proposal)
from transformers import TextStreamer

from dflash2_tools.tiny_targets import tiny_glm5_next


@pytest.fixture(scope="module")
def tree_module():
    return root.tree()


def test_best_first_tree_keeps_the_most_probable_nodes(tree_module):
    candidates = [[10, 11, 12], [20, 21, 22], [30, 31, 32]]  # [n=3][K=3]
    table = {0: [0.6, 0.3, 0.1], 1: [0.9, 0.05, 0.05], 2: [0.5, 0.4, 0.1]}  # position -> child probabilities, any parent
    log_probs = [[torch.tensor(table[t]).log().tolist()] * 3 for t in range(3)]  # [n][K parent][K child]
    tree = tree_module.build_tree(7, candidates, log_probs, budget=4, max_depth=3)
    # path probabilities: 10 .6, 10-20 .54, 11 .3, 10-20-30 .27 (beats 11-20 .27? tie broken by order), ...
    assert tree.tokens[0] == 7 and len(tree) == 5
    # laid out depth-first, best child first: the most probable path 7-10-20-30 takes the first slots
    assert tree.tokens[1:] == [10, 20, 30, 11] or tree.tokens[1:] == [10, 20, 11, 20]
    assert tree.parents[:3] == [-1, 0, 1] and tree.depths[:3] == [0, 1, 2]
    assert all(tree.parents[i] < i for i in range(1, len(tree)))  # parents precede their children
    for node in range(len(tree)):
        kids = [tree.tokens[c] for c in tree.children[node]]
        assert len(kids) == len(set(kids))  # distinct children: no duplicate paths
    shallow = tree_module.build_tree(7, candidates, log_probs, budget=20, max_depth=1)
    assert max(shallow.depths) == 1 and len(shallow) == 4  # depth limit (e.g. max_new_tokens) caps the tree
    assert len(tree_module.build_tree(7, candidates, log_probs, budget=0, max_depth=3)) == 1
    # the n-gram branch shares the prefix it has in common with the tree
    merged = tree_module.add_branch(tree, [10, 20, 99, 98])
    assert len(merged) == 7 and merged.tokens[-2:] == [99, 98] and merged.parents[-2] == 2


def test_lattice_scores_every_parent_at_once(tree_module):
    """The one-transfer lattice equals the selector's own scores S_t(parent, .) for every parent column."""
    drafter = tiny_drafter()
    torch.manual_seed(0)
    hidden, logits = torch.randn(4, 48), torch.randn(4, VOCAB)
    candidates, log_probs = root.selector().lattice_lists(root.selector().lattice_table(drafter, hidden, logits, None, 5).cpu())
    selector = drafter.candidate_selector
    top_values, top_ids = logits.topk(selector.top_k, dim=-1)
    gated = selector.hidden_projection(hidden)
    assert candidates == top_ids.tolist()
    for t in range(4):
        for j in range(selector.top_k):
            parent = torch.tensor([5 if t == 0 else candidates[t - 1][j]])
            want = torch.log_softmax(selector.scores(gated[t : t + 1], top_values[t : t + 1], top_ids[t : t + 1], parent)[0], -1)
            torch.testing.assert_close(torch.tensor(log_probs[t][j]), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("selector", [True, False], ids=["selector", "no-selector"])
def test_a_batchs_lattices_are_each_rows_own(tree_module, selector):
    """A batch scores every row's lattice in the same kernels: each row equals its own one-row lattice."""
    drafter = tiny_drafter()
    if not selector:
        drafter.candidate_selector = None
    torch.manual_seed(1)
    hidden, logits = torch.randn(3, 4, 48), torch.randn(3, 4, VOCAB)  # [b, n, H], [b, n, V]
    anchors = [5, 11, 2]
    batched = root.selector().lattice_table(drafter, hidden, logits, None, torch.tensor(anchors))  # [b, n, 1 + K, K]
    for i, anchor in enumerate(anchors):
        torch.testing.assert_close(batched[i], root.selector().lattice_table(drafter, hidden[i], logits[i], None, anchor))
    if selector:  # the anchor matters at position 0: another row's anchor would give another table
        assert not torch.equal(batched[0, 0], root.selector().lattice_table(drafter, hidden[0], logits[0], None, anchors[1])[0])


def test_ancestor_mask_and_tree_attention_mask(tree_module):
    tree = tree_module.root_tree(5)
    a = tree.add(1, 0)
    b = tree.add(2, 0)
    c = tree.add(3, a)
    mask = torch.tensor(tree.ancestor_mask())
    assert mask[c].tolist() == [True, True, False, True] and mask[b].tolist() == [True, False, True, False]
    full = tree_module.tree_attention_mask(tree, torch.tensor([1, 0, 1]), torch.float32)[0, 0]  # [N, 3 + N]
    assert (full[:, 1] < -1e30).all() and (full[:, [0, 2]] == 0).all()  # the context's own padding stays masked
    assert ((full[:, 3:] == 0) == mask).all()
    # a batch: each row's own context mask and tree, padded to 6 rows over 10 keys (a static cache's stale slots)
    chain = tree_module.add_branch(tree_module.root_tree(9), [4, 4])
    past = torch.tensor([[1, 0, 1], [0, 1, 1]])
    batch = tree_module.tree_attention_mask([tree, chain], past, torch.float32, key_length=10, n_rows=6)  # [2, 1, 6, 10]
    assert batch.shape == (2, 1, 6, 10)
    for row, (t, context) in enumerate(zip([tree, chain], past)):
        allowed = batch[row, 0] == 0  # [6, 10]
        n = len(t)
        assert (allowed[:n, :3] == context.bool()).all() and not allowed[n:, :3].any()  # padding rows: no context
        assert (allowed[:, 3:9] == torch.tensor(t.ancestor_mask(6))).all() and not allowed[:, 9].any()


def test_cache_keeps_the_accepted_path_in_order(tree_module):
    """The loop's commit after a tree step: the kept nodes first in the step's slots (``kept_first``), the rest cut."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache()
    keys = torch.arange(7, dtype=torch.float32).view(1, 1, 7, 1).expand(1, 2, 7, 3).contiguous()  # past 3 + 4 nodes
    cache.update(keys, keys + 100, 0)
    holes = root.holes()
    holes.kept_first(cache, 3, [[0, 2, 3]], kept=3)
    holes.crop_tail(cache, 1)
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 5, 6]
    assert cache.layers[0].values[0, 1, :, 0].tolist() == [100, 101, 102, 103, 105, 106]


def test_walk_draws_exactly_from_p_for_any_candidate_set(tree_module):
    """One draw per node, made before the walk: the law of the root's next token (a child or the bonus) is p."""
    accept = root.accept()
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    tree = tree_module.root_tree(0)
    for token in (3, 4, 2):  # children that do not follow p's order
        tree.add(token, 0)
    logits = p.log()[None].expand(len(tree), -1)  # [N, V]
    n = 6000
    counts = torch.zeros(5)
    for _ in range(n):
        path, bonus = accept.accepted_path(tree, accept.target_choices(tree, logits, True, generator=g).tolist())
        counts[tree.tokens[path[1]] if len(path) > 1 else bonus] += 1
    expected = {i: float(p[i]) for i in range(5)}
    assert chi_square_p_value({i: int(counts[i]) for i in range(5)}, expected, n) > 1e-3

    def no_renormalisation(tree, probs, generator=None):  # accept child c w.p. p(c), not p(c)/mass left
        for child in tree.children[0]:
            if torch.rand((), generator=generator) < probs[tree.tokens[child]]:
                return [0, child], -1
        return [0], int(torch.multinomial(probs, 1, generator=generator))

    counts = torch.zeros(5)
    for _ in range(n):
        path, bonus = no_renormalisation(tree, p, g)
        counts[tree.tokens[path[1]] if len(path) > 1 else bonus] += 1
    assert chi_square_p_value({i: int(counts[i]) for i in range(5)}, expected, n) < 1e-3  # the test has power


def test_the_walk_follows_the_choices_and_stops_at_the_first_miss(tree_module):
    accept = root.accept()
    tree = tree_module.root_tree(9)
    a, b = tree.add(4, 0), tree.add(5, 0)
    c = tree.add(6, b)
    choices = [5, 0, 6, 8]  # per node: root -> 5 (node b), b -> 6 (node c), c -> 8 (no child: the bonus)
    assert accept.accepted_path(tree, choices) == ([0, b, c], 8)
    assert accept.accepted_path(tree, [7, 0, 0, 0]) == ([0], 7)
    assert a == 1


@pytest.mark.parametrize("vocab", [49152, 50001, 1031, 7])  # whole blocks, a short last block, few blocks, under one
def test_first_argmax_is_argmax_with_its_ties(vocab):
    accept = root.accept()
    g = torch.Generator().manual_seed(vocab)
    ties = torch.randint(0, 3, (4, 9, vocab), generator=g).float()  # every row has its maximum many times
    last = ties.clone()
    last[..., -1] = 7.0  # the maximum in the last (short) block only
    for logits in (torch.randn(4, 9, vocab, generator=g), ties, last, ties[0]):
        assert torch.equal(accept.first_argmax(logits), logits.argmax(-1))


def test_processors_see_each_nodes_own_prefix_once_per_depth(tree_module):
    """Nodes of one depth are processed in one call, each row with its own prefix after the committed ids."""
    accept = root.accept()
    tree = tree_module.root_tree(9)
    a, b = tree.add(4, 0), tree.add(5, 0)
    c = tree.add(6, b)
    seen = []

    class Record(list):
        def __call__(self, ids, scores):  # a one-entry processor list
            seen.append(ids.tolist())
            return scores + ids[:, -1:].float()  # a processor that depends on the prefix

    raw = torch.zeros(4, 10)
    out = accept.process_tree(raw, tree, [1, 2], 0, 1, Record([0]))  # one row of a one-row call
    assert seen == [[[1, 2]], [[1, 2, 4], [1, 2, 5]], [[1, 2, 5, 6]]]  # one call per depth
    assert out[:, 0].tolist() == [2, 4, 5, 6] and out[c, 3] == 6 and out[a, 0] == 4


@pytest.fixture(scope="module")
def trained_pair():
    from conftest import overfit_drafter

    target = tiny_target("llama")
    drafter, prompts = overfit_drafter(target, steps=60)
    return target, drafter, prompts


@pytest.mark.parametrize("budget", [1, 5, 24, "auto"])
@pytest.mark.parametrize("ngram", [0, 6])
def test_tree_greedy_equals_the_target(trained_pair, monkeypatch, budget, ngram):
    target, drafter, prompts = trained_pair
    monkeypatch.setattr(drafter.config, "tree_budget", budget)
    gen = root.generation_of(drafter)
    for prompt in prompts[:3]:
        ids = torch.tensor([prompt[:6]])
        ref = target.generate(ids, do_sample=False, max_new_tokens=40, eos_token_id=None, pad_token_id=0)
        out, stats = gen.dflash2_generate(target, drafter, ids, do_sample=False, max_new_tokens=40, eos_token_id=None,
                                          pad_token_id=0, prompt_lookup_num_tokens=ngram)
        assert torch.equal(out, ref)
        assert set(stats.proposers) == {"dflash2-tree"} and stats.new_tokens == 40
        assert sum(stats.accept_lengths) == 39  # the prefill's token comes first, every other one from a tree step
    assert max(stats.accept_lengths) > 1  # the trees do get tokens accepted


def test_tree_greedy_on_qwen3_with_processors_eos_and_max_length(monkeypatch):
    from conftest import overfit_drafter

    target = tiny_target("qwen3")
    drafter, prompts = overfit_drafter(target, steps=40)
    monkeypatch.setattr(drafter.config, "tree_budget", 8)
    ids = torch.tensor([prompts[1][:7]])
    for max_new in (1, 2, 5, 13):
        kw = dict(do_sample=False, max_new_tokens=max_new, eos_token_id=None, pad_token_id=0, repetition_penalty=1.3)
        assert torch.equal(target.generate(ids, assistant_model=drafter, **kw), target.generate(ids, **kw))
    ref = target.generate(ids, do_sample=False, max_new_tokens=30, eos_token_id=None, pad_token_id=0)
    eos = int(ref[0, ids.shape[1] + 9])  # a token the continuation emits: generation must stop right after it
    kw = dict(do_sample=False, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(target.generate(ids, assistant_model=drafter, **kw), target.generate(ids, **kw))


def test_tree_return_dict_scores_cache_and_streamer(trained_pair, monkeypatch, capsys):
    target, drafter, prompts = trained_pair
    monkeypatch.setattr(drafter.config, "tree_budget", 6)
    ids = torch.tensor([prompts[0][:6]])
    kw = dict(do_sample=False, max_new_tokens=20, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True,
              output_scores=True, output_logits=True)
    ref = target.generate(ids, **kw)
    out = target.generate(ids, assistant_model=drafter, **kw)
    assert torch.equal(out.sequences, ref.sequences) and len(out.scores) == len(out.logits) == 20
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert out.past_key_values.get_seq_length() == out.sequences.shape[1] - 1  # every committed token but the last
    torch.testing.assert_close(out.past_key_values.layers[0].keys, ref.past_key_values.layers[0].keys[..., : out.sequences.shape[1] - 1, :],
                               atol=1e-4, rtol=1e-4)  # the accepted path's K/V, in order

    class Tokens(TextStreamer):
        def __init__(self):
            self.seen = []

        def put(self, value):
            self.seen += value.view(-1).tolist()

        def end(self):
            self.seen.append("end")

    streamer = Tokens()
    target.generate(ids, assistant_model=drafter, streamer=streamer, do_sample=False, max_new_tokens=20, eos_token_id=None, pad_token_id=0)
    assert streamer.seen == ref.sequences[0].tolist() + ["end"]
    with pytest.raises(ValueError, match="output_hidden_states"):
        target.generate(ids, assistant_model=drafter, return_dict_in_generate=True, output_hidden_states=True, max_new_tokens=3, pad_token_id=0)


def test_tree_mode_refuses_stateful_targets(monkeypatch):
    target = tiny_glm5_next()
    layers = target.config.get_text_config().num_hidden_layers
    drafter = tiny_drafter(target, target_layer_ids=[0, layers - 1], target_hidden_reduction="mean", conv_group_size=8)
    monkeypatch.setattr(drafter.config, "tree_budget", 4)
    with pytest.raises(ValueError, match="stateful target"):
        target.generate(torch.tensor([[3, 4, 5]]), assistant_model=drafter, do_sample=False, max_new_tokens=4, pad_token_id=0)


@pytest.mark.parametrize("processors", [False, True], ids=["plain", "processors"])
def test_tree_sampling_matches_target_distribution(setup, monkeypatch, processors):  # noqa: F811
    target, drafter, prompt = setup
    monkeypatch.setattr(drafter.config, "tree_budget", 6)
    monkeypatch.setattr(drafter.config, "hybrid_ngram", {"costs": FREE_COSTS})
    temperature, top_p, penalty = (0.7, 0.9, 1.3) if processors else (1.0, 1.0, 1.0)
    expected = exact_joint(target, prompt, _processors(temperature, top_p, penalty))
    counts = {}
    with root.generation().collect_stats() as runs:
        for seed in range(SAMPLES):
            torch.manual_seed(seed)
            out = target.generate(prompt, assistant_model=drafter, do_sample=True, max_new_tokens=N_NEW, temperature=temperature,
                                  top_p=top_p, top_k=0, repetition_penalty=penalty, pad_token_id=0)
            cell = tuple(out[0, prompt.shape[1]:].tolist())
            counts[cell] = counts.get(cell, 0) + 1
    assert sum(r.accepted for r in runs) > 0 and all(set(r.proposers) == {"dflash2-tree"} for r in runs)
    assert chi_square_p_value(counts, expected, SAMPLES) > 1e-3


def test_auto_budget_follows_the_costs(tree_module):
    """Where verification is nearly free (native bf16, a GPU) a tree commits the most per cost; where a multi-token
    token of a forward costs 0.38 of a decode (emulated bf16 on an AVX2 CPU) one path or a plain step does."""
    ngram = root.ngram_of(tiny_drafter())
    acceptance = [0.432, 0.209, 0.107, 0.045, 0.031, 0.015, 0.011]
    cheap, values = tree_module.choose_tree_budget(ngram.StepCosts(0.05, 0.005, 0.2), acceptance)
    assert cheap in tree_module.TREE_GAIN and values[f"tree-{cheap}"] == max(values.values())
    free, _ = tree_module.choose_tree_budget(ngram.StepCosts(0.0, 0.0, 0.0), acceptance)
    assert free == max(tree_module.TREE_GAIN)  # nothing costs more: the biggest tree
    dear, values = tree_module.choose_tree_budget(ngram.StepCosts(0.0, 0.38, 0.55), acceptance)
    assert dear == 0 and max(values.values()) == max(v for k, v in values.items() if not k.startswith("tree"))


def test_tree_mode_keeps_the_version_guard(trained_pair, monkeypatch):
    target, drafter, prompts = trained_pair
    monkeypatch.setattr(drafter.config, "tree_budget", 4)
    pretend_transformers_version(monkeypatch, "5.99.0")
    with pytest.raises(RuntimeError, match="tested with transformers"):
        target.generate(torch.tensor([prompts[0]]), assistant_model=drafter, do_sample=False, max_new_tokens=4, pad_token_id=0)


def host_transfers_per_forward(target, drafter, ids, max_new_tokens, **generate_kwargs) -> float:
    from dflash2_tools.host_transfers import transfers_per_forward

    kwargs = {"do_sample": False, "max_new_tokens": max_new_tokens} | generate_kwargs
    return transfers_per_forward(target, drafter, {"input_ids": ids}, **kwargs)[0]


def test_tree_step_host_transfers_do_not_grow_with_the_budget():
    """One transfer for the whole lattice: the count per target forward is a small constant at 8 and 64 nodes
    (it was ~130 and ~850 when the tree was grown with a transfer per expanded node), and one path per step
    (the same loop) stays under the same bound."""
    target = tiny_target("llama")
    ids = torch.tensor([[3, 5, 7, 9]])
    per_forward = {}
    for budget in (None, 8, 64):
        drafter = tiny_drafter(target, block_size=9, tree_budget=budget)
        per_forward[budget] = host_transfers_per_forward(target, drafter, ids, 40)
    assert all(count <= 24 for count in per_forward.values()), per_forward
    assert abs(per_forward[64] - per_forward[8]) <= 3, per_forward


def test_sampling_step_host_transfers_do_not_grow_with_the_budget():
    """Sampling with processors: every node's draw is made on the device and fetched in one transfer, and the
    processors run once per depth, so the count per target forward does not grow with the budget either."""
    target = tiny_target("llama")
    ids = torch.tensor([[3, 5, 7, 9]])
    per_forward = {}
    for budget in (None, 8, 64):
        drafter = tiny_drafter(target, block_size=9, tree_budget=budget)
        torch.manual_seed(0)
        per_forward[budget] = host_transfers_per_forward(target, drafter, ids, 40, do_sample=True, temperature=0.8,
                                                         top_p=0.9, repetition_penalty=1.2)
    assert all(count <= 24 for count in per_forward.values()), per_forward
    assert abs(per_forward[64] - per_forward[8]) <= 3, per_forward
