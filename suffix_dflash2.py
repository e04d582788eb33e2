"""Suffix drafting: what the target wrote in EARLIER calls, proposed as a small tree of continuations.

People call one model many times on similar work (extraction from many records, edits of one file, tool loops); the
target repeats itself across calls far more than inside one prompt, and a continuation copied from earlier outputs
costs nothing to draft. ``SuffixIndex`` is held by the drafter object for the process (``drafter.suffix_index``):

* a ring of the last ``max_tokens`` indexed tokens (each document: the tail of its prompt, then the output, then a
  separator); a new document overwrites the oldest tokens (eviction of the oldest, O(1));
* per context order k (``orders``), a hash table [buckets, ``per_bucket``] of the ring positions that followed the
  most recent occurrences of each k-gram (round robin per bucket: older occurrences drop out);
* ``lookup(context)``: the longest order whose k-gram ends the context and occurred before; each candidate occurrence
  is checked token by token (a hash collision or an evicted slot is dropped), and their continuations (at most
  ``max_depth`` tokens, stopping at a separator) are merged into a trie that counts them: a node's probability is
  the share of occurrences that continue along it (SuffixDecoding's empirical frequency, over recent occurrences).

A lookup reads at most ``len(orders) * per_bucket`` occurrences of at most ``max(orders) + max_depth`` tokens: its
cost depends on the proposal's size, never on how many tokens are indexed. The index changes only between calls
(``add`` when a call ends), so a proposal depends on committed tokens only and verification stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

_MULT = np.uint64(0x100000001B3)  # FNV-style polynomial hash of a k-gram, wrapping mod 2^64 like numpy's uint64
_MIX = np.uint64(0x9E3779B97F4A7C15)
_MULT_INT, _MIX_INT = int(_MULT), int(_MIX)  # the same, as Python ints for one hash at a time
_MASK = (1 << 64) - 1
SEPARATOR = -1  # ends a document in the ring
# P(a continuation's token is the target's) ~ count(token) / (count(its parent) + SMOOTHING[order]): fit on the target's
# regenerated responses (dev split walked with an index over the train split; ``python -m dflash2_tools.calibrate_suffix``,
# docs/suffix/calibration.json). A long match is trusted at its frequency; a 2-token match needs many agreeing occurrences.
SMOOTHING = {2: 3.9, 4: 1.05, 8: 0.1}


@dataclass
class SuffixTrie:
    """Continuations of one matched context. Node 0 is the root (the context's end); ``counts[i]`` the occurrences
    that continue through node i (``counts[0]``: all of them); parents precede their children."""

    match_length: int
    tokens: list[int] = field(default_factory=lambda: [-1])
    parents: list[int] = field(default_factory=lambda: [-1])
    counts: list[int] = field(default_factory=lambda: [0])
    children: list[dict] = field(default_factory=lambda: [{}])

    def add(self, continuation) -> None:
        node = 0
        self.counts[0] += 1
        for token in continuation:
            child = self.children[node].get(token)
            if child is None:
                child = len(self.tokens)
                self.tokens.append(token)
                self.parents.append(node)
                self.counts.append(0)
                self.children.append({})
                self.children[node][token] = child
            self.counts[child] += 1
            node = child

    def probability(self, node: int) -> float:
        return self.counts[node] / self.counts[0]

    def best_path(self, length: int, smoothing: float = 0.0) -> tuple[list[int], list[float]]:
        """The most frequent continuation (ties: the first seen) and, per token, its acceptance estimate
        count(token) / (count(parent) + smoothing) (0: the plain frequency)."""
        tokens, rates, node = [], [], 0
        while len(tokens) < length and self.children[node]:
            child = max(self.children[node].values(), key=lambda c: self.counts[c])
            tokens.append(self.tokens[child])
            rates.append(self.counts[child] / (self.counts[node] + smoothing))
            node = child
        return tokens, rates

    def smoothing(self) -> float:
        """``SMOOTHING`` at this match's order (the nearest calibrated order at or below it)."""
        below = [k for k in SMOOTHING if k <= self.match_length]
        return SMOOTHING[max(below)] if below else SMOOTHING[min(SMOOTHING)]

    def top_nodes(self, budget: int) -> list[int]:
        """The ``budget`` most probable nodes (a node's ancestors are at least as probable: the set is a subtree)."""
        nodes = sorted(range(1, len(self.tokens)), key=lambda i: (-self.counts[i], i))[:budget]
        return sorted(nodes)

    def branches(self, budget: int) -> list[list[int]]:
        """The paths to the leaves of ``top_nodes(budget)``, best first: what a token tree merges as branches."""
        keep = set(self.top_nodes(budget))
        leaves = [i for i in sorted(keep, key=lambda i: (-self.counts[i], i)) if not any(c in keep for c in self.children[i].values())]
        paths = []
        for leaf in leaves:
            path, node = [], leaf
            while node > 0:
                path.append(self.tokens[node])
                node = self.parents[node]
            paths.append(path[::-1])
        return paths


def _hash_windows(tokens: np.ndarray, k: int) -> np.ndarray:
    """Hashes of every k-gram of ``tokens`` ([n] int64) -> [n - k + 1] uint64."""
    n = len(tokens) - k + 1
    h = np.zeros(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(k):
            h = h * _MULT + (tokens[j : j + n] + 1).astype(np.uint64)
    return h


def _hash_one(tokens: list[int]) -> int:
    h = 0
    for t in tokens:
        h = (h * _MULT_INT + t + 1) & _MASK
    return h


class SuffixIndex:
    """A bounded index over earlier calls' outputs (module doc). ``max_tokens``: the ring's size (the memory cap);
    ``orders``: the context lengths matched, longest first; ``per_bucket``: occurrences kept per k-gram (the
    frequency sample); ``prompt_tail``: prompt tokens stored before each output (so a response's first tokens match
    the chat template's tail); ``max_depth``: the longest continuation read."""

    def __init__(self, max_tokens: int = 1 << 20, orders=(2, 4, 8), per_bucket: int = 8, prompt_tail: int = 8,
                 max_depth: int = 16):
        if max_tokens < 64 or per_bucket < 1 or not orders or min(orders) < 1 or max_depth < 1:
            raise ValueError(f"SuffixIndex needs max_tokens >= 64, per_bucket >= 1, orders >= 1 and max_depth >= 1; got "
                             f"max_tokens={max_tokens}, orders={orders}, per_bucket={per_bucket}, max_depth={max_depth}")
        self.max_tokens, self.orders, self.per_bucket = int(max_tokens), tuple(sorted(set(orders))), int(per_bucket)
        self.prompt_tail, self.max_depth = int(prompt_tail), int(max_depth)
        self.enabled = True
        # buckets: twice the k-grams the ring can hold over the occurrences a bucket keeps (few collisions)
        self.bits = max(8, (2 * self.max_tokens // self.per_bucket - 1).bit_length())
        self.clear()

    def clear(self) -> None:
        """Forget everything (the tables keep their memory)."""
        self.ring = np.full(self.max_tokens, SEPARATOR, dtype=np.int32)
        self.total = 0  # tokens ever written (the next absolute position)
        self.documents = 0
        # ring slots (int32) of the tokens that followed each k-gram; a slot overwritten since reads other tokens,
        # which ``lookup`` checks anyway (a k-gram still in the ring with those tokens IS an earlier occurrence)
        self.tables = {k: np.full((1 << self.bits, self.per_bucket), -1, dtype=np.int32) for k in self.orders}
        self.written = {k: np.zeros(1 << self.bits, dtype=np.int64) for k in self.orders}

    def __len__(self) -> int:
        """Indexed tokens still in the ring (separators included)."""
        return min(self.total, self.max_tokens)

    @property
    def nbytes(self) -> int:
        """Memory held: the ring and the tables."""
        return self.ring.nbytes + sum(t.nbytes for t in self.tables.values()) + sum(w.nbytes for w in self.written.values())

    def _bucket(self, h):
        """Buckets of many k-gram hashes (writing): the top ``bits`` bits of ``h * _MIX`` mod 2^64."""
        with np.errstate(over="ignore"):
            return ((np.asarray(h, dtype=np.uint64) * _MIX) >> np.uint64(64 - self.bits)).astype(np.int64)

    def _bucket_of(self, h: int) -> int:
        """``_bucket`` of one hash in plain integers (a lookup per step: no numpy scalars and error states)."""
        return ((h * _MIX_INT) & _MASK) >> (64 - self.bits)

    # ---- writing ------------------------------------------------------------------------------------------------

    def add(self, output: list[int], prompt: list[int] | None = None) -> None:
        """Index one call's ``output`` after the last ``prompt_tail`` tokens of its ``prompt``."""
        if not output:
            return
        doc = list(prompt[-self.prompt_tail:] if prompt and self.prompt_tail else []) + [int(t) for t in output]
        doc = doc[-(self.max_tokens - 1):]  # a document longer than the ring keeps its end
        tokens = np.asarray(doc, dtype=np.int64)
        start = self.total
        positions = (start + np.arange(len(doc) + 1)) % self.max_tokens
        self.ring[positions] = np.append(tokens, SEPARATOR).astype(np.int32)
        self.total += len(doc) + 1
        self.documents += 1
        for k in self.orders:
            if len(doc) <= k:
                continue
            buckets = self._bucket(_hash_windows(tokens[:-1], k))  # k-grams with a successor in the document
            follow = (start + k + np.arange(len(buckets))) % self.max_tokens  # ring slot of each k-gram's successor
            self._insert(k, buckets, follow)

    def _insert(self, k: int, buckets: np.ndarray, follow: np.ndarray) -> None:
        """Round robin per bucket, in document order; only the last ``per_bucket`` of a bucket are written."""
        order = np.argsort(buckets, kind="stable")
        sorted_buckets, sorted_follow = buckets[order], follow[order]
        unique, first, counts = np.unique(sorted_buckets, return_index=True, return_counts=True)
        rank = np.arange(len(order)) - np.repeat(first, counts)  # place within its bucket's run
        keep = rank >= np.repeat(counts, counts) - self.per_bucket
        slot = (self.written[k][sorted_buckets] + rank) % self.per_bucket
        self.tables[k][sorted_buckets[keep], slot[keep]] = sorted_follow[keep]
        self.written[k][unique] += counts

    def seed(self, documents, prompts=None) -> None:
        """Index a corpus (e.g. the target's regenerated training responses), oldest first."""
        for i, doc in enumerate(documents):
            self.add(doc, None if prompts is None else prompts[i])

    # ---- reading ------------------------------------------------------------------------------------------------

    def _read(self, slot: int, n: int) -> list[int]:
        """Up to ``n`` tokens from ring slot ``slot`` (negative: counted back from the ring's end), stopping at a
        separator or at the write head (the oldest token is not the newest's successor)."""
        to_head = (self.total - slot) % self.max_tokens  # 0: the slot IS the head (the oldest token, or unwritten)
        n = min(n, to_head or (self.max_tokens if self.total >= self.max_tokens else 0))
        slot %= self.max_tokens
        out = (self.ring[slot : slot + n] if slot + n <= self.max_tokens else self.ring[(slot + np.arange(n)) % self.max_tokens]).tolist()
        return out[: out.index(SEPARATOR)] if SEPARATOR in out else out

    def lookup(self, context: list[int], max_depth: int | None = None) -> SuffixTrie | None:
        """The trie of continuations after the longest order k whose last-k context tokens occurred before, or None."""
        if not self.enabled or self.total == 0:
            return None
        depth = self.max_depth if max_depth is None else min(max_depth, self.max_depth)
        for k in reversed(self.orders):
            if len(context) < k:
                continue
            tail = [int(t) for t in context[-k:]]
            bucket = self._bucket_of(_hash_one(tail))
            trie = None
            for follow in self.tables[k][bucket].tolist():
                if follow < 0 or self._read(follow - k, k) != tail:
                    continue  # empty, another k-gram in the same bucket, or overwritten since
                trie = trie or SuffixTrie(match_length=k)
                trie.add(self._read(follow, depth))
            if trie is not None and len(trie.tokens) > 1:
                return trie
        return None

    # ---- keeping ------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"max_tokens": self.max_tokens, "orders": list(self.orders), "per_bucket": self.per_bucket,
                "prompt_tail": self.prompt_tail, "max_depth": self.max_depth, "total": self.total,
                "documents": self.documents}

    def save(self, path) -> None:
        """One ``.npz`` file: the ring, the tables and the settings."""
        arrays = {"ring": self.ring, **{f"table_{k}": t for k, t in self.tables.items()},
                  **{f"written_{k}": w for k, w in self.written.items()}}
        meta = np.frombuffer(repr(self.state_dict()).encode(), dtype=np.uint8)
        with open(path, "wb") as f:  # a file object: numpy would otherwise append ".npz" to another suffix
            np.savez_compressed(f, meta=meta, **arrays)

    @classmethod
    def load(cls, path) -> SuffixIndex:
        import ast

        if not Path(path).is_file():
            raise FileNotFoundError(f"no suffix index at {path}: save one with drafter.suffix_index.save(path)")
        with np.load(path) as data:
            meta = ast.literal_eval(bytes(data["meta"]).decode())
            index = cls(meta["max_tokens"], meta["orders"], meta["per_bucket"], meta["prompt_tail"], meta["max_depth"])
            index.ring = data["ring"].copy()
            index.tables = {k: data[f"table_{k}"].copy() for k in index.orders}
            index.written = {k: data[f"written_{k}"].copy() for k in index.orders}
        index.total, index.documents = meta["total"], meta["documents"]
        return index


__all__ = ["SEPARATOR", "SMOOTHING", "SuffixIndex", "SuffixTrie"]
