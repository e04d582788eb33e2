"""Hybrid drafting: copied continuations (prompt lookup, the suffix index) beside the DFlash 2 block draft, and the
rule that picks what a step verifies.

Code and math quote their prompts and small models repeat themselves: there a match over earlier text predicts long
runs for free, where the drafter is weakest. ``HybridRule`` verifies the proposal prefix with the most expected tokens
per unit of cost (acceptance calibrated by ``python -m dflash2_tools.calibrate_hybrid``; costs measured per device),
and skips the drafter when a copy beats even a fully confident draft. The rule reads only committed text and this
step's draft, so q is fixed before verification: exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class NgramMatch:
    """A continuation copied from earlier text: this call's (``"ngram"``, prompt lookup) or earlier calls'
    (``"suffix"``, ``suffix_dflash2``: ``rates`` are its tokens' acceptance estimates from their frequencies)."""

    tokens: list[int]  # the continuation after the earlier occurrence
    match_length: int  # n of the matched n-gram
    proposer: str = "ngram"
    rates: list[float] | None = None  # per token; None: the rule's table for the match length


def suffix_match(trie, num_tokens: int) -> NgramMatch | None:
    """The suffix index's most frequent continuation as a copied proposal, each token's acceptance estimated from
    its count after its parent (``SuffixTrie.smoothing``: calibrated per match length)."""
    if trie is None:
        return None
    tokens, rates = trie.best_path(num_tokens, trie.smoothing())
    return NgramMatch(tokens, trie.match_length, "suffix", rates)


class NgramIndex:
    """Latest earlier occurrence of every n-gram (``min_n <= n <= max_n``) of a growing token list: prompt lookup."""

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.ids: list[int] = []
        self.latest_end: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest occurrence with a successor

    def extend(self, new_ids: list[int]) -> None:
        start = len(self.ids)
        self.ids.extend(new_ids)
        ids, last = self.ids, len(self.ids) - 1  # the n-grams ending at start..last get a successor now
        for n in range(self.min_n, self.max_n + 1):
            first = max(start, n)
            grams = zip(*(ids[first - n + j : last - n + j + 1] for j in range(n)))  # ids[end - n : end], end = first..last
            self.latest_end.update(zip(grams, range(first, last + 1)))  # ascending: the latest occurrence wins

    def lookup(self, num_tokens: int) -> NgramMatch | None:
        """Continuation of the longest n-gram suffix that occurred before, or None; an occurrence ending fewer than
        ``num_tokens`` back is a loop, and the continuation repeats its period."""
        length = len(self.ids)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            end = self.latest_end.get(tuple(self.ids[length - n :]))
            if end is not None:
                period = length - end
                return NgramMatch([self.ids[end + i % period] for i in range(num_tokens)], n)
        return None


@dataclass
class Proposal:
    proposer: str  # "dflash2" (the block draft), "ngram", or "none" (a plain one-token step)
    length: int  # how many of its tokens to verify


@dataclass
class StepCosts:
    """Costs in one-token target forwards: verifying L >= 1 drafted tokens costs ``1 + multi_token_step + per_token * L``,
    a drafter forward ``draft``. A measured ``curve`` ((width, cost), ascending) replaces the line: interpolated, and
    extended along its last segment (a CPU's cost is not a line). Each length's cost is computed once per call."""

    multi_token_step: float = 0.0
    per_token: float = 0.0
    draft: float = 0.0
    curve: tuple | None = None  # ((width, cost), ...): at least two widths, increasing
    _verify: dict = field(default_factory=dict, repr=False, compare=False)  # length -> cost, filled as asked

    def verify(self, length: int) -> float:
        cost = self._verify.get(length)
        if cost is None:
            cost = self._verify[length] = self._interpolate(length)
        return cost

    def _interpolate(self, length: int) -> float:
        if not length:
            return 1.0
        if self.curve is None:
            return 1.0 + self.multi_token_step + self.per_token * length
        width = length + 1
        (w0, c0), (w1, c1) = next((pair for pair in zip(self.curve, self.curve[1:]) if width <= pair[1][0]), self.curve[-2:])
        return c0 + (c1 - c0) * (width - w0) / (w1 - w0)  # inside the segment, or along the last one past its end


def expected_prefixes(rates: list[float], factor: float = 1.0) -> list[float]:
    """Tokens committed in expectation by verifying the first L tokens of a proposal with per-token acceptance
    ``rates``, for every L = 0..len(rates), the bonus token included: ``1 + factor * sum_{i<=L} prod_{j<=i} a_j``
    (``factor`` scales the drafted part: a proposer's measured acceptance against its calibration)."""
    out, run, total = [1.0], 1.0, 0.0
    for a in rates:
        run *= a
        total += run
        out.append(1.0 + factor * total)
    return out


def expected_tokens(rates: list[float], factor: float = 1.0) -> float:
    """``expected_prefixes`` of the whole proposal."""
    return expected_prefixes(rates, factor)[-1]


@dataclass
class HybridRule:
    """Which proposal to verify, and how much of it: the most expected tokens per unit of time.

    Per-token acceptance: the draft's ``min(1, drafter_scale * c_j)`` (``c_j`` the selector's probability of its pick),
    a copy's ``ngram_acceptance[match length]`` (or its own ``rates``). Verifying the first L tokens commits
    ``1 + f * sum_{i<=L} prod_{j<=i} a_j`` tokens (``f``: this call's accepted / predicted for the proposer) for
    ``costs.verify(L)``: on a GPU everything is verified, on a CPU unlikely tails are cut. A copy wins when its value
    plus ``ngram_margin`` beats the draft's."""

    ngram_acceptance: list[float]
    drafter_scale: float
    ngram_margin: float
    drafter_acceptance: list[float]
    costs: StepCosts
    prior_tokens: float = 8.0  # strength of the calibration against this call's own outcomes
    outcomes: dict = field(default_factory=lambda: {"dflash2": [0.0, 0.0], "ngram": [0.0, 0.0], "suffix": [0.0, 0.0],
                                                    "tree": [0.0, 0.0]})  # [accepted, predicted]

    def factor(self, proposer: str) -> float:
        accepted, predicted = self.outcomes[proposer]
        return (self.prior_tokens + accepted) / (self.prior_tokens + predicted)

    def record(self, proposal: Proposal, rates: list[float], accepted: int) -> None:
        """After verification: accepted tokens against the estimate, for ``factor``."""
        if proposal.proposer in self.outcomes and proposal.length:
            self.outcomes[proposal.proposer][0] += accepted
            self.outcomes[proposal.proposer][1] += expected_tokens(rates[: proposal.length]) - 1.0

    def _best(self, rates: list[float], factor: float = 1.0, extra_cost: float = 0.0) -> tuple[float, int]:
        """(expected tokens per cost, length) of the best prefix of a proposal (length 0: verify none of it)."""
        best, length = 1.0 / (1.0 + extra_cost), 0
        for i, expected in enumerate(expected_prefixes(rates, factor)[1:], start=1):
            cost = self.costs.verify(i)
            value = expected / (cost + extra_cost)
            if value > best + 1e-9 or (value >= best - 1e-9 and cost == 1.0):
                best, length = value, i
        return best, length

    def drafter_rates(self, confidences: list[float]) -> list[float]:
        return [min(1.0, self.drafter_scale * c) for c in confidences]

    def ngram_rates(self, match: NgramMatch) -> list[float]:
        if match.rates is not None:
            return match.rates
        table = self.ngram_acceptance
        return [table[min(match.match_length, len(table) - 1)]] * len(match.tokens)

    def margin(self, match: NgramMatch) -> float:
        """``ngram_margin`` is prompt lookup's (fit with its table); an index's frequencies stand on their own."""
        return self.ngram_margin if match.proposer == "ngram" else 0.0

    def _ngram_value(self, match: NgramMatch | None) -> tuple[float, int]:
        if not (match and match.tokens):
            return 1.0, 0
        return self._best(self.ngram_rates(match), self.factor(match.proposer))

    def better_match(self, *matches: NgramMatch | None) -> NgramMatch | None:
        """The copied continuation worth the most per unit of cost (prompt lookup's margin included), or None."""
        best, best_value = None, float("-inf")
        for match in matches:
            if match and match.tokens:
                value = self._ngram_value(match)[0] + self.margin(match)
                if value > best_value:
                    best, best_value = match, value
        return best

    def mean_drafter_rates(self, n_draft: int) -> list[float]:
        """Per-token acceptance of a draft before it is drawn: P(i accepted | i-1 accepted) from the calibration."""
        cumulative = self.drafter_acceptance[:n_draft]
        return [p / q if q > 0 else 0.0 for p, q in zip(cumulative, [1.0, *cumulative])]

    def choose(self, match: NgramMatch | None, confidences: list[float] | None) -> Proposal:
        """The proposal to verify; ``confidences`` None when the drafter did not run this step."""
        value, choice = 1.0, Proposal("none", 0)
        if confidences is not None:
            value, length = self._best(self.drafter_rates(confidences), self.factor("dflash2"))
            choice = Proposal("dflash2", length) if length else choice
        n_value, n_length = self._ngram_value(match)
        if n_length and n_value + self.margin(match) > value:
            choice = Proposal(match.proposer, n_length)
        return choice


@dataclass
class PathProposal:
    """One path for one row's step: the rule's choice, its per-token acceptance rates (what the rule records), the
    tokens, and log q [L, V] of each token's proposal distribution when they were sampled from the drafter (None:
    deterministic tokens -- greedy, or the n-gram's point mass)."""

    choice: Proposal
    rates: list[float]
    tokens: list[int]
    log_q: object = None  # torch.Tensor [L, V] or None


def _at(prefixes: list[float], length: int) -> float:
    """A proposal's expected tokens at ``length`` (``expected_prefixes``; past its end: the whole proposal)."""
    return prefixes[min(length, len(prefixes) - 1)]


def batch_length(proposals: list[PathProposal], rules: list[HybridRule], costs: StepCosts) -> int:
    """The one proposal length L the step verifies for every row: the least expected tokens of any row per unit of the
    batch's cost (a batch runs until its slowest row is done; summing over rows lost to the target's batched
    generate, docs/design.md). Where verification is free (a GPU) the longest wins."""
    rows = [expected_prefixes(p.rates[: len(p.tokens)], rule.factor(p.choice.proposer) if p.choice and p.choice.proposer in
                              rule.outcomes else 1.0) for p, rule in zip(proposals, rules)]  # per row, per length

    def value(length: int) -> float:
        return min(_at(row, length) for row in rows) / costs.verify(length)

    return best_length(sorted({0} | {len(p.tokens) for p in proposals}), value, costs.verify)


def best_length(lengths: list[int], value, cost) -> int:
    """Of ``lengths`` (ascending), the one of the highest ``value(L)``; a tie goes to the longer one where ``cost(L)``
    is no higher (verification free: the longer can only gain), else to the shorter."""
    best, best_value = lengths[0], value(lengths[0])
    for length in lengths[1:]:
        v = value(length)
        if v > best_value + 1e-9 or (v >= best_value - 1e-9 and cost(length) <= cost(best)):
            best, best_value = length, v
    return best


def _copied_prefixes(rules: list[HybridRule], matches: list) -> list[list[float]]:
    """Per row: its copied continuation's ``expected_prefixes`` (its proposer's factor applied; [1.0] without one)."""
    return [expected_prefixes(rule.ngram_rates(m), rule.factor(m.proposer)) if m and m.tokens else [1.0]
            for rule, m in zip(rules, matches)]


def draft_pays(rules: list[HybridRule], matches: list, n_draft: list[int], costs: StepCosts) -> bool:
    """Before drafting: does a draft (calibrated mean acceptance, its forward included) promise more per unit of cost
    than the rows' copies (plus ``ngram_margin``) or a plain step? Valued by the row that gains least, as
    ``batch_length``; the one gate for one row and for a batch."""
    copies = _copied_prefixes(rules, matches)
    margins = [rule.margin(m) if m and m.tokens else 0.0 for rule, m in zip(rules, matches)]
    drafts = [expected_prefixes(rule.mean_drafter_rates(n), rule.factor("dflash2")) if n else None
              for rule, n in zip(rules, n_draft)]

    def value(length: int, with_draft: bool) -> float:
        cost = costs.verify(length) + (costs.draft if with_draft else 0.0)

        def row(copy: list[float], margin: float, draft: list[float] | None) -> float:
            options = [1.0 / cost]
            if with_draft and draft is not None:
                options.append(_at(draft, length) / cost)
            if len(copy) > 1:
                options.append(_at(copy, length) / cost + margin)
            return max(options)

        return min(row(*args) for args in zip(copies, margins, drafts))

    longest = max([len(m.tokens) for m in matches if m] + n_draft)
    without = max(value(length, False) for length in range(longest + 1))
    return max((value(length, True) for length in range(1, max(n_draft) + 1)), default=0.0) > without


def copy_beats_tree(rules: list[HybridRule], matches: list, tree_tokens: list[float], tree_nodes: int, costs: StepCosts) -> int:
    """Before a tree step: how many copied tokens to verify ALONE (chains, no drafter forward), or 0 to draft the tree
    (which carries the copies as branches). Valued by the row that gains least: a tree row commits the better of
    ``tree_tokens[i]`` and its copy for ``verify(tree_nodes + longest) + draft``, a copy step of L tokens each row's
    first L copied tokens for ``verify(L)`` (a row without a copy: its bonus, so it keeps the batch on trees)."""
    copies = _copied_prefixes(rules, matches)
    longest = max(len(row) for row in copies) - 1
    if longest == 0:
        return 0
    union = min(max(t, row[-1]) for t, row in zip(tree_tokens, copies))
    best_value, best = union / (costs.verify(tree_nodes + longest) + costs.draft), 0
    for length in range(1, longest + 1):
        value = min(_at(row, length) for row in copies) / costs.verify(length)
        if value > best_value + 1e-9:
            best_value, best = value, length
    return best


def tree_branch_length(rules: list[HybridRule], matches: list, tree_tokens: list[float], tree_nodes: int, costs: StepCosts) -> int:
    """How many copied tokens a tree step carries beside its lattice: the L of the most tokens per unit of
    ``verify(tree_nodes + L) + draft``, each row the better of its tree and its copy's first L, SUMMED over rows (every
    row keeps its tree; the branch widens the whole forward; measured in docs/design.md)."""
    copies = _copied_prefixes(rules, matches)

    def value(length: int) -> float:
        return sum(max(t, _at(row, length)) for t, row in zip(tree_tokens, copies)) / (costs.verify(tree_nodes + length) + costs.draft)

    return best_length(list(range(max(len(row) for row in copies))), value, lambda length: costs.verify(tree_nodes + length))


def cut(proposal: PathProposal, length: int) -> PathProposal:
    """The proposal's first ``length`` tokens (the batch's length); nothing left is a plain step for the row."""
    if length >= len(proposal.tokens):
        return proposal
    kept = proposal.tokens[:length]
    choice = Proposal(proposal.choice.proposer if kept else "none", len(kept))
    log_q = None if proposal.log_q is None else proposal.log_q[:length]
    return PathProposal(choice, proposal.rates, kept, log_q)


