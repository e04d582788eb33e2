"""Hybrid drafting: a prompt-lookup (n-gram) proposer beside the DFlash 2 block draft.

Small models repeat themselves, code and math quote their prompts: there an n-gram match
over the prompt + generated text predicts long runs for free, while the drafter is weakest
exactly where text is copied from far back. Where the text is new, there is no match and the
drafter's block draft stands. Each step:

    1. extend the n-gram index with the tokens committed since the last step (incremental:
       a dict from each n-gram to the end of its latest earlier occurrence)
    2. look up the context's last n tokens, n from ``max_n`` down to ``min_n``: the longest
       match gives a continuation of up to ``num_tokens`` tokens
    3. score both proposals by their expected accepted length: the drafter's from its
       per-position confidences, the n-gram's from its match length (tables calibrated on
       data, ``python -m dflash2_tools.calibrate_hybrid``); verify the higher-scoring one.
       When the n-gram beats even a fully confident draft, the drafter forward is skipped
       (its context features wait for the next draft)

The rule reads only the committed context and this step's draft, so the proposal is fixed
before the target verifies it: q is the point mass on an n-gram token and the selector's
softmax on a drafted one, and speculative sampling stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class NgramMatch:
    tokens: list[int]  # the continuation after the earlier occurrence
    match_length: int  # n of the matched n-gram


class NgramIndex:
    """Latest earlier occurrence of every n-gram (``min_n <= n <= max_n``) of a growing token list."""

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.ids: list[int] = []
        self.latest_end: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest occurrence with a successor

    def extend(self, new_ids: list[int]) -> None:
        for token in new_ids:
            end = len(self.ids)  # the n-grams ending here get a successor now
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.latest_end[tuple(self.ids[end - n : end])] = end
            self.ids.append(token)

    def lookup(self, num_tokens: int) -> NgramMatch | None:
        """Continuation of the longest n-gram suffix that occurred before, or None.

        The latest occurrence may end less than ``num_tokens`` before the context does (a loop
        of period p = length - end): the continuation then repeats that period, which is what
        the text does if the loop goes on.
        """
        length = len(self.ids)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            end = self.latest_end.get(tuple(self.ids[length - n :]))
            if end is not None:
                period = length - end
                return NgramMatch([self.ids[end + i % period] for i in range(num_tokens)], n)
        return None


@dataclass
class HybridRule:
    """Expected accepted length of each proposal; the larger one is verified.

    drafter: sum_i prod_{j<=i} min(1, drafter_scale * c_j), c_j the selector's (temperature-1)
    probability of its own pick at position j. n-gram: sum_i a^i with a = ``ngram_acceptance[m]``
    for match length m (the last entry for longer matches). ``ngram_margin`` is added to the
    n-gram's score (negative: prefer the drafter on ties).
    """

    ngram_acceptance: list[float]
    drafter_scale: float
    ngram_margin: float

    def drafter_score(self, confidences: list[float]) -> float:
        score, run = 0.0, 1.0
        for c in confidences:
            run *= min(1.0, self.drafter_scale * c)
            score += run
        return score

    def ngram_score(self, match: NgramMatch) -> float:
        table = self.ngram_acceptance
        a = table[min(match.match_length, len(table) - 1)]
        return sum(a ** (i + 1) for i in range(len(match.tokens))) + self.ngram_margin

    def ngram_certain(self, match: NgramMatch | None, n_draft: int) -> bool:
        """The n-gram wins whatever the draft says (its score beats a draft with every confidence 1):
        the drafter forward can be skipped this step."""
        return bool(match and match.tokens) and self.ngram_score(match) > self.drafter_score([1.0] * n_draft)

    def use_ngram(self, match: NgramMatch | None, confidences: list[float]) -> bool:
        return bool(match and match.tokens) and self.ngram_score(match) > self.drafter_score(confidences)
