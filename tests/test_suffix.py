"""Suffix drafting: the drafter's index over earlier calls' outputs (suffix_dflash2), and the engine using it.

* the index: counts and probabilities against a brute-force count, the longest order first, hash collisions and
  evicted slots never proposed, a token budget that evicts the oldest, a lookup whose work does not grow with what
  is indexed, save / load / clear / off;
* the engine: greedy output equal to the target's own with suffix proposals forced (paths, trees, a batch, a
  stateful target), the index learning from calls, and each row's sampling distribution kept (chi-square).
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import FREE_COSTS, root, tiny_drafter, tiny_target
from test_engine_matrix import assert_rows_keep_their_distribution, drafter_shape, left_padded, make_target
from test_sampling import V

suffix = root._sibling("suffix_dflash2")
ngram = root._sibling("ngram_dflash2")


def brute_force(documents: list[list[int]], context: list[int], orders, depth: int, per_bucket: int):
    """(order, continuations) of the most recent ``per_bucket`` occurrences of the longest order that occurred."""
    for k in sorted(orders, reverse=True):
        if len(context) < k:
            continue
        found = [doc[i + k : i + k + depth] for doc in documents for i in range(len(doc) - k) if doc[i : i + k] == context[-k:]]
        if found:
            return k, found[-per_bucket:]
    return None, []


def test_lookup_counts_what_followed_the_longest_match():
    rng = random.Random(0)
    index = suffix.SuffixIndex(max_tokens=1 << 16, orders=(1, 2, 4), per_bucket=6, prompt_tail=0, max_depth=5)
    documents = [[rng.randrange(12) for _ in range(rng.randrange(5, 40))] for _ in range(30)]
    for doc in documents:
        index.add(doc)
    grams = {k: {tuple(doc[i : i + k]) for doc in documents for i in range(len(doc) - k)} for k in (1, 2, 4)}
    owners = {}  # (order, bucket) -> the k-grams hashed there: a shared bucket keeps fewer of each one's occurrences
    for k, found in grams.items():
        for gram in found:
            owners.setdefault((k, int(index._bucket(suffix._hash_one(list(gram))))), set()).add(gram)
    exact = 0
    for _ in range(300):
        context = [rng.randrange(12) for _ in range(rng.randrange(1, 8))]
        if any(len(owners.get((k, int(index._bucket(suffix._hash_one(context[-k:])))), ())) > 1 for k in (1, 2, 4) if len(context) >= k):
            continue
        exact += 1
        k, found = brute_force(documents, context, (1, 2, 4), 5, 6)
        trie = index.lookup(context)
        if k is None:
            assert trie is None
            continue
        assert trie.match_length == k and trie.counts[0] == len(found)
        for node in range(1, len(trie.tokens)):  # a node's count: the occurrences continuing through it
            path, i = [], node
            while i > 0:
                path.insert(0, trie.tokens[i])
                i = trie.parents[i]
            assert trie.counts[node] == sum(f[: len(path)] == path for f in found)
        tokens, rates = trie.best_path(5)
        firsts = [f[0] for f in found if f]
        assert firsts.count(tokens[0]) == max(firsts.count(t) for t in firsts)  # the most frequent continuation
        assert all(0 < r <= 1 for r in rates)
    assert exact > 150  # most contexts were compared exactly


def test_one_hash_at_a_time_lands_where_the_writes_put_it():
    """The per-step lookup hashes and buckets one k-gram in plain integers; the writes do it for many with numpy."""
    import numpy as np

    index = suffix.SuffixIndex(max_tokens=1 << 12, orders=(3,))
    rng = random.Random(0)
    tokens = [rng.randrange(50_000) for _ in range(200)]
    hashes = suffix._hash_windows(np.asarray(tokens, dtype=np.int64), 3)  # [198] uint64
    assert [suffix._hash_one(tokens[i : i + 3]) for i in range(198)] == [int(h) for h in hashes]
    assert [index._bucket_of(int(h)) for h in hashes] == index._bucket(hashes).tolist()


def test_a_crowded_table_and_an_overwritten_ring_propose_only_real_text():
    """A 64-token ring and 256 buckets: k-grams collide and slots are overwritten; every proposal still follows a
    real occurrence of the context in what the ring holds now."""
    rng = random.Random(1)
    index = suffix.SuffixIndex(max_tokens=64, orders=(2, 3), per_bucket=2, prompt_tail=0, max_depth=4)
    held: list[int] = []
    for _ in range(200):
        doc = [rng.randrange(6) for _ in range(rng.randrange(3, 20))]
        index.add(doc)
        held = (held + doc + [suffix.SEPARATOR])[-64:]
        context = [rng.randrange(6) for _ in range(4)]
        trie = index.lookup(context)
        if trie is None:
            continue
        k = trie.match_length
        for leaf_path in trie.branches(64):
            text = context[-k:] + leaf_path
            assert any(held[i : i + len(text)] == text for i in range(len(held))), (text, held)


def test_the_token_budget_evicts_the_oldest():
    index = suffix.SuffixIndex(max_tokens=100, orders=(2,), prompt_tail=0)
    index.add([1, 2, 3, 4, 5])
    assert index.lookup([1, 2]).best_path(3)[0] == [3, 4, 5]
    for i in range(30):  # 30 x 5 tokens (+ separators): the first document is overwritten
        index.add([50 + i, 51 + i, 52 + i, 53 + i])
    assert len(index) == 100 and index.documents == 31
    assert index.lookup([1, 2]) is None
    assert index.lookup([79, 80]).best_path(2)[0] == [81, 82]  # the newest stays


def test_lookup_work_does_not_grow_with_the_indexed_tokens(monkeypatch):
    """Tokens read per lookup: bounded by orders x occurrences kept x (order + depth), the same at 2K and 2M tokens."""
    reads = []
    original = suffix.SuffixIndex._read

    def counting(self, slot, n):
        out = original(self, slot, n)
        reads.append(len(out))
        return out

    g = torch.Generator().manual_seed(0)
    per_size = {}
    for size in (2_000, 2_000_000):
        index = suffix.SuffixIndex(max_tokens=size, orders=(2, 4, 8), per_bucket=8, max_depth=16)
        for _ in range(size // 20_000 or 1):
            index.add(torch.randint(0, 50, (min(size - 1, 20_000),), generator=g).tolist())  # a small vocabulary: many matches
        monkeypatch.setattr(suffix.SuffixIndex, "_read", counting)
        reads.clear()
        for _ in range(50):
            index.lookup(torch.randint(0, 50, (8,), generator=g).tolist())
        monkeypatch.setattr(suffix.SuffixIndex, "_read", original)
        per_size[size] = max(reads)
        assert len(reads) <= 50 * 3 * 8 and max(reads) <= 16
    assert per_size[2_000] == per_size[2_000_000] == 16


def test_save_load_clear_and_off(tmp_path):
    index = suffix.SuffixIndex(max_tokens=4096)
    index.seed([[5, 6, 7, 8, 9], [5, 6, 7, 1, 2]], prompts=[[1, 2, 3], [1, 2, 3]])
    path = tmp_path / "index.npz"
    index.save(path)
    loaded = suffix.SuffixIndex.load(path)
    assert loaded.state_dict() == index.state_dict()
    for context in ([2, 3], [6, 7], [3, 5, 6]):
        a, b = index.lookup(context), loaded.lookup(context)
        assert (a.tokens, a.counts) == (b.tokens, b.counts)
    loaded.enabled = False
    assert loaded.lookup([6, 7]) is None
    index.clear()
    assert len(index) == 0 and index.lookup([6, 7]) is None
    with pytest.raises(FileNotFoundError, match="save one"):
        suffix.SuffixIndex.load(tmp_path / "missing.npz")
    with pytest.raises(ValueError, match="max_tokens"):
        suffix.SuffixIndex(max_tokens=8)


def test_the_drafter_holds_one_index_and_refuses_other_things(monkeypatch):
    monkeypatch.setenv("DFLASH2_SUFFIX_INDEX", "1")  # the default outside the tests
    drafter = tiny_drafter(tiny_target("llama"))
    assert drafter.suffix_index is drafter.suffix_index and len(drafter.suffix_index) == 0
    drafter.suffix_index = suffix.SuffixIndex(max_tokens=128)
    assert drafter.suffix_index.max_tokens == 128
    drafter.suffix_index = None
    assert drafter.suffix_index is None
    with pytest.raises(TypeError, match="SuffixIndex or None"):
        drafter.suffix_index = {"tokens": 5}


# ---- through the engine --------------------------------------------------------------------------------------------


def force_suffix(monkeypatch):
    """Every row verifies its suffix proposal whenever the index has one (whatever the rule would pick)."""
    better, choose = ngram.HybridRule.better_match, ngram.HybridRule.choose

    def prefer(self, *matches):
        found = [m for m in matches if m and m.proposer == "suffix" and m.tokens]
        return found[0] if found else better(self, *matches)

    def forced(self, match, confidences):
        if match is not None and match.proposer == "suffix" and match.tokens:
            return ngram.Proposal("suffix", len(match.tokens))
        return choose(self, match, confidences)

    monkeypatch.setattr(ngram.HybridRule, "better_match", prefer)
    monkeypatch.setattr(ngram.HybridRule, "choose", forced)


def force_tree_step(drafter, mode: str, monkeypatch):
    """Tree calls: "tree" always drafts the tree (copies as branches), "copies" verifies the copies alone whenever
    every row has one (the drafter skipped); a path call leaves the rule alone."""
    if mode in ("tree", "copies"):
        module = root.proposer_of(drafter)
        monkeypatch.setattr(module, "copy_beats_tree", lambda rules, matches, *rest: 0 if mode == "tree" else
                            max((len(m.tokens) for m in matches if m), default=0) * all(matches))


@pytest.mark.parametrize("kind,batch,mode", [("llama", 1, "path"), ("llama", 4, "path"), ("llama", 1, "tree"),
                                            ("llama", 4, "tree"), ("llama", 1, "copies"), ("llama", 4, "copies"),
                                            ("glm5_next", 4, "path")])
def test_greedy_equals_the_target_with_suffix_proposals(kind, batch, mode, monkeypatch):
    target = make_target(kind)
    drafter = tiny_drafter(target, seed=3, **drafter_shape(target))
    monkeypatch.setattr(drafter.config, "hybrid_ngram", {**drafter.config.hybrid_settings(), "costs": FREE_COSTS, "num_tokens": 6})
    monkeypatch.setattr(drafter.config, "tree_budget", None if mode == "path" else 4)
    force_suffix(monkeypatch)
    force_tree_step(drafter, mode, monkeypatch)
    rows = [[5, 9, 2, 7, 1, 4, 3], [8, 3, 1], [2, 6, 4, 4, 9], [7, 7, 1, 5]][:batch]
    ids, mask = left_padded(rows)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None)
    want = target.generate(**kw)
    rng = random.Random(2)  # earlier "calls": half the target's own text (accepted), half noise (rejected)
    drafter.suffix_index = suffix.SuffixIndex()
    drafter.suffix_index.seed([[rng.randrange(60) for _ in range(30)] for _ in range(20)])
    drafter.suffix_index.seed([row[ids.shape[1] - 4 : ids.shape[1] + 10] for row in want.tolist()])
    proposer_class, found = root.proposer_of(drafter).Proposer, []
    original_trie = proposer_class.suffix_trie

    def spy(self, row, num_tokens):  # the index's continuations the steps were given (trees merge them as branches)
        trie = original_trie(self, row, num_tokens)
        found.append(trie is not None)
        return trie

    monkeypatch.setattr(proposer_class, "suffix_trie", spy)
    with root.generation().collect_stats() as runs:
        got = target.generate(**kw, assistant_model=drafter)
    assert sum(found) > 0
    assert torch.equal(got, want)
    stats = runs[-1].as_dict()
    if mode != "tree":  # paths, and tree calls whose copies went alone: suffix steps with hits and misses
        used = stats["per_proposer"]["suffix"]
        assert used["steps"] > 0 and 0 < used["accepted"] < used["drafted"], stats["per_proposer"]
    if mode != "path":
        assert stats["per_proposer"].get("dflash2-tree", {}).get("steps", 0) > 0, stats["per_proposer"]  # and trees
    assert stats["accepted"] > 0
    before = drafter.suffix_index.documents
    again = target.generate(**kw, assistant_model=drafter)  # the call's outputs were indexed: the same call again
    assert torch.equal(again, want) and drafter.suffix_index.documents == before + batch


def test_a_warm_index_commits_more_per_forward():
    """The same request twice: the second call reads the first's output from the index (a random drafter alone
    accepts little)."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target, seed=3)
    drafter.suffix_index = suffix.SuffixIndex()
    drafter.config.hybrid_ngram = {**drafter.config.hybrid_settings(), "costs": FREE_COSTS}
    ids = torch.tensor([[5, 9, 2, 7, 1, 4, 3]])
    kw = dict(max_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=None, assistant_model=drafter)
    with root.generation().collect_stats() as runs:
        first = target.generate(ids, **kw)
        second = target.generate(ids, **kw)
    assert torch.equal(first, second)
    assert runs[1].forwards * 2 <= runs[0].forwards, (runs[0].forwards, runs[1].forwards)
    assert runs[1].as_dict()["per_proposer"]["suffix"]["accepted"] >= 20


SAMPLES = 600


@pytest.mark.parametrize("batch,mode", [(1, "path"), (4, "path"), (1, "tree"), (4, "tree"), (1, "copies"), (4, "copies")])
def test_sampling_with_suffix_proposals_keeps_each_rows_distribution(batch, mode, monkeypatch):
    target = make_target("llama", vocab=V, seed=5, head_scale=2.8)
    target.generation_config.eos_token_id = None
    drafter = tiny_drafter(target, seed=7, mask_token_id=V - 1, selector_top_k=3, block_size=4, conv_group_size=16,
                           target_layer_ids=[0, 1, 2])
    monkeypatch.setattr(drafter.config, "hybrid_ngram", {**drafter.config.hybrid_settings(), "costs": FREE_COSTS, "num_tokens": 3})
    monkeypatch.setattr(drafter.config, "tree_budget", None if mode == "path" else 3)
    force_suffix(monkeypatch)
    force_tree_step(drafter, mode, monkeypatch)
    rng = random.Random(0)  # every short context occurred before, followed by arbitrary tokens: q far from p
    drafter.suffix_index = suffix.SuffixIndex()
    drafter.suffix_index.seed([[rng.randrange(V - 1) for _ in range(60)] for _ in range(4)])
    runs = assert_rows_keep_their_distribution(target, drafter, [[1, 3, 2], [4, 1], [2], [3, 0, 1]][:batch], SAMPLES)
    if mode != "tree":
        assert sum(r.per_proposer.get("suffix", {}).get("drafted", 0) for r in runs) > SAMPLES // 2  # suffix tokens were verified
