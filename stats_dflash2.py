"""What a DFlash 2 generation did: ``DFlash2Stats``, and the context managers that collect it.

Nothing is left on modules: every candidate generator created inside ``collect_stats()`` (or
``trace_proposals()``) appends its record to the list the block yields.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

@dataclass
class DFlash2Stats:
    """What one generation did. ``accept_lengths[i]``: tokens committed by draft-verify step i
    (accepted drafts + the target's bonus token), i.e. tokens per target forward."""

    block_size: int
    accept_lengths: list[int] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    new_tokens: int = 0
    seconds: float = 0.0
    draft_seconds: float = 0.0
    rollback_seconds: float = 0.0  # stateful targets: snapshot + replay of linear-attention states
    proposers: list[str] = field(default_factory=list)  # per step: "dflash2" (block draft), "ngram" (prompt lookup), "dflash2-tree", "none" (nothing verified)
    per_proposer: dict = field(default_factory=dict)  # proposer -> {"steps", "drafted", "accepted"}
    costs: dict = field(default_factory=dict)  # the step costs the rule used and their "source" (config / measured / table)
    mode: str = "linear"  # "linear" (one path per step) or "tree-N" (tree verification with N nodes)
    batch_size: int = 1  # rows of the call; with more than one, every row's step is recorded (pooled) above
    forwards: int = 0  # batched calls: target verification forwards (one serves every row)
    row_accept_lengths: list = field(default_factory=list)  # batched calls: per row, tokens per forward

    def __post_init__(self):
        n = self.block_size - 1
        self.drafted_per_position = self.drafted_per_position or [0] * n
        self.accepted_per_position = self.accepted_per_position or [0] * n

    def record_step(self, drafted: int, accepted: int, proposer: str = "dflash2", depth: int | None = None) -> None:
        """One verification: ``drafted`` tokens (tree: nodes) proposed, ``accepted`` of them kept. Per-position
        rates count block drafts by position and trees by depth (``depth``: the tree's deepest node)."""
        self.accept_lengths.append(accepted + 1)
        self.proposers.append(proposer)
        self.drafted += drafted
        self.accepted += accepted
        counts = self.per_proposer.setdefault(proposer, {"steps": 0, "drafted": 0, "accepted": 0})
        counts["steps"] += 1
        counts["drafted"] += drafted
        counts["accepted"] += accepted
        if proposer not in ("dflash2", "dflash2-tree"):  # per-position rates are the drafter's (an n-gram run may be longer)
            return
        for i in range(min(drafted if depth is None else depth, len(self.drafted_per_position))):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += int(i < accepted)

    def merge(self, other: "DFlash2Stats") -> "DFlash2Stats":
        """Pool another run's steps into this one (e.g. over a prompt set): counts and times add, per-step lists
        (and every pooled batch's rows) extend in order."""
        for name in ("accept_lengths", "proposers", "row_accept_lengths", "drafted", "accepted", "new_tokens", "seconds",
                     "draft_seconds", "rollback_seconds", "forwards"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("drafted_per_position", "accepted_per_position"):
            setattr(self, name, [a + b for a, b in zip(getattr(self, name), getattr(other, name))])
        self.batch_size = max(self.batch_size, other.batch_size)
        for name, counts in other.per_proposer.items():
            mine = self.per_proposer.setdefault(name, {"steps": 0, "drafted": 0, "accepted": 0})
            for key in mine:
                mine[key] += counts[key]
        return self

    @property
    def mean_acceptance_length(self) -> float:
        return sum(self.accept_lengths) / max(len(self.accept_lengths), 1)

    @property
    def per_position_acceptance(self) -> list[float]:
        """P(draft position i accepted | drafted), i = 1..B-1 (acceptance implies all earlier accepted)."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def histogram(self) -> dict[int, int]:
        out = {k: 0 for k in range(1, self.block_size + 1)}
        for length in self.accept_lengths:
            out[length] = out.get(length, 0) + 1
        return out

    @property
    def seconds_per_token(self) -> float:
        return self.seconds / max(self.new_tokens, 1)

    def as_dict(self) -> dict:
        fields = ("mean_acceptance_length", "drafted", "accepted", "new_tokens", "seconds", "draft_seconds", "rollback_seconds",
                  "seconds_per_token", "per_position_acceptance", "accept_lengths", "proposers", "costs", "mode",
                  "batch_size", "forwards")
        return {
            **{name: getattr(self, name) for name in fields},
            "steps": len(self.accept_lengths),
            "acceptance_length_histogram": self.histogram(),
            "row_mean_acceptance_length": [sum(r) / max(len(r), 1) for r in self.row_accept_lengths],
            "per_proposer": {
                name: {**c, "mean_acceptance_length": (c["accepted"] + c["steps"]) / max(c["steps"], 1)}
                for name, c in self.per_proposer.items()
            },
        }


STATS_SINK: contextvars.ContextVar[list | None] = contextvars.ContextVar("dflash2_stats_sink", default=None)
TRACE_SINK: contextvars.ContextVar[list | None] = contextvars.ContextVar("dflash2_trace_sink", default=None)


@contextlib.contextmanager
def _collect_into(sink: contextvars.ContextVar):
    """Every candidate generator created inside the block appends to the yielded list."""
    items: list = []
    token = sink.set(items)
    try:
        yield items
    finally:
        sink.reset(token)


def trace_proposals():
    """``with trace_proposals() as steps: target.generate(...)``: per step, both proposals (the block
    draft with its confidences, the n-gram continuation with its match length) and the position,
    whichever was verified; ``dflash2_tools.calibrate_hybrid`` fits the hybrid rule from them."""
    return _collect_into(TRACE_SINK)


def collect_stats():
    """``with collect_stats() as runs: target.generate(..., assistant_model=drafter)`` -> runs[-1] is a DFlash2Stats."""
    return _collect_into(STATS_SINK)


__all__ = ["DFlash2Stats", "STATS_SINK", "TRACE_SINK", "collect_stats", "trace_proposals"]
