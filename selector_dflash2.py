"""The candidate selector (SPEC 2b) and what reads the drafter's logits: one path, the whole lattice, a sub-vocabulary.

* ``DFlash2CandidateSelector.walk``: one coherent path from the anchor through the per-position top-K (greedy, or
  sampled at the generation temperature: q, the proposal distribution exact sampling needs);
* ``lattice_table``: the selector's scores for every (parent candidate, child candidate) pair at every position, the
  input of tree verification (``tree_dflash2.build_tree``), moved to the host in one transfer;
* ``DraftVocabHead``: the target's LM head on the tokens the target actually emits (the drafter's draft vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_dflash2 import DFlash2Config
from .devices_dflash2 import module_weights


@dataclass
class SelectorWalk:
    """One coherent path through the per-position top-K candidates.

    tokens:     [b, n] chosen token at each drafted position
    candidates: [b, n, K] candidate ids per position
    log_q:      [b, n, K] log-probabilities of the proposal over the candidates (the chosen
                predecessor is the path's own previous token); at temperature 0 a one-hot.
    confidence: [b, n] softmax(S) (temperature 1) of the chosen candidate: how sure the walk is,
                read by the hybrid n-gram rule to estimate the draft's accepted length.
    """

    tokens: torch.Tensor
    candidates: torch.Tensor
    log_q: torch.Tensor
    confidence: torch.Tensor

    def full_vocab_logits(self, vocab_size: int) -> torch.Tensor:
        """log q scattered over the vocabulary (-inf outside the candidates): softmax gives q exactly."""
        b, n, _ = self.log_q.shape
        out = self.log_q.new_full((b, n, vocab_size), float("-inf"))
        return out.scatter(-1, self.candidates, self.log_q)


class DFlash2CandidateSelector(nn.Module):
    """S_t(a, b) = U_t(b) + < A[a] * g_t , B[b] >   (SPEC 2b), over b in the top-K of the draft logits."""

    def __init__(self, config: DFlash2Config):
        super().__init__()
        self.top_k = config.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(config.vocab_size, config.selector_rank))
        self.successor_codebook = nn.Parameter(torch.zeros(config.vocab_size, config.selector_rank))
        self.hidden_projection = nn.Linear(config.hidden_size, config.selector_rank, bias=False)

    def scores(self, gated: torch.Tensor, top_values: torch.Tensor, top_ids: torch.Tensor, predecessors: torch.Tensor):
        """gated = hidden_projection(h): [..., R]; top_values/top_ids: [..., K]; predecessors: [...] -> S: [..., K]."""
        pred = self.predecessor_codebook[predecessors].to(gated.dtype) * gated  # [..., R]
        succ = self.successor_codebook[top_ids].to(gated.dtype)  # [..., K, R]
        return top_values + torch.einsum("...r,...kr->...k", pred, succ)

    def walk(
        self,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        anchor_ids: torch.Tensor,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        vocab_ids: torch.Tensor | None = None,
    ) -> SelectorWalk:
        """Walk from the anchor: greedy (T=0) or sampled from softmax(S/T) over the candidates.

        hidden: [b, n, H] drafter hidden at drafted positions; logits: [b, n, V]; anchor_ids: [b].
        vocab_ids: [V'] when ``logits`` cover a sub-vocabulary ([b, n, V']): maps its columns to token ids.
        """
        top_values, top_ids = logits.float().topk(self.top_k, dim=-1)  # [b, n, K]
        if vocab_ids is not None:
            top_ids = vocab_ids[top_ids]  # [b, n, K] sub-vocabulary columns -> token ids
        gated = self.hidden_projection(hidden).float()  # [b, n, R]
        prev = anchor_ids
        tokens, log_qs, confidences = [], [], []
        for t in range(logits.shape[1]):
            s = self.scores(gated[:, t], top_values[:, t], top_ids[:, t], prev)  # [b, K]
            if temperature > 0:
                log_q = F.log_softmax(s / temperature, dim=-1)  # [b, K]
                pick = torch.multinomial(log_q.exp(), 1, generator=generator).squeeze(-1)  # [b]
            else:
                pick = s.argmax(dim=-1)  # [b]
                log_q = torch.full_like(s, float("-inf")).scatter(-1, pick[:, None], 0.0)
            prev = top_ids[:, t].gather(-1, pick[:, None]).squeeze(-1)  # [b]
            tokens.append(prev)
            log_qs.append(log_q)
            confidences.append(F.softmax(s, dim=-1).gather(-1, pick[:, None]).squeeze(-1))  # [b]
        return SelectorWalk(torch.stack(tokens, 1), top_ids, torch.stack(log_qs, 1), torch.stack(confidences, 1))


class DraftVocabHead(nn.Module):
    """The target's LM head restricted to a sub-vocabulary: logits [..., V'] for token ids ``vocab_ids``.

    Built once per generation call (a copy of V' rows of the target's head, never saved). On a
    CPU the full head (V x H) costs more than the drafter's layers; drafting from the tokens
    the target actually emits keeps nearly every hit at a fraction of that cost.
    """

    def __init__(self, lm_head: nn.Module, vocab_ids: list[int]):
        super().__init__()
        with module_weights(lm_head):  # real rows, also when accelerate offloaded the head
            weight = lm_head.weight
            self.register_buffer("vocab_ids", torch.tensor(vocab_ids, dtype=torch.long, device=weight.device), persistent=False)
            self.register_buffer("weight", weight.detach()[self.vocab_ids].contiguous(), persistent=False)  # [V', H]
            bias = getattr(lm_head, "bias", None)
            self.register_buffer("bias", None if bias is None else bias.detach()[self.vocab_ids], persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear_head(hidden, self.weight, self.bias)  # [..., V']


def linear_head(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[..., H] -> [..., V] = hidden @ weight.T (+ bias), computed as ``weight @ rows.T`` over 2-D rows.

    Why not ``F.linear(hidden, weight)``: with a non-contiguous N-D input (a slice of the block)
    it falls back to a broadcast bmm, ~8x slower fwd+bwd on a CPU; and on CPU BLAS the
    weight-major product is 1.2-3x faster for few rows (7 drafted positions) than F.linear.
    """
    rows = hidden.reshape(-1, hidden.shape[-1])  # [N, H] (copies only if hidden is not viewable)
    logits = (weight @ rows.T).T  # [N, V]
    if bias is not None:
        logits = logits + bias
    return logits.reshape(*hidden.shape[:-1], weight.shape[0])  # [..., V]


def lattice_table(drafter, hidden: torch.Tensor, logits: torch.Tensor, vocab_ids: torch.Tensor | None, anchor) -> torch.Tensor:
    """A block's top-K lattice, scored at once on the device: [..., n, 1 + K, K], row 0 the candidates' token ids (as
    floats), rows 1.. the log-probs ``[t][j][k]`` of candidate k at position t after candidate j of position t - 1.

    hidden [..., n, H], logits [..., n, V'] at the drafted positions, ``anchor`` an int or a tensor of the leading
    shape (a batch scores every row's lattice in the same kernels). With a selector, ``log_probs[t][j]`` is log
    softmax S_t(candidate j of position t - 1, .) over the top-K (the anchor for t = 0); without one, the log softmax
    of the draft logits over the top-K, whatever the parent.
    """
    selector = drafter.candidate_selector
    k = selector.top_k if selector is not None else min(8, logits.shape[-1])
    top_values, top_cols = logits.float().topk(k, dim=-1)  # [..., n, K]
    candidates = top_cols if vocab_ids is None else vocab_ids[top_cols]  # [..., n, K] token ids
    if selector is None:
        table = torch.log_softmax(top_values, dim=-1).unsqueeze(-2).expand(*top_values.shape[:-1], k, k)  # [..., n, K, K]
    else:
        gated = selector.hidden_projection(hidden).float()  # [..., n, R]
        first = torch.as_tensor(anchor, device=candidates.device)[..., None, None].expand(*candidates.shape[:-2], 1, k)  # [..., 1, K]
        parents = torch.cat([first, candidates[..., :-1, :]], dim=-2)  # [..., n, K]: position t's possible parents
        # the walk's own scores, for every parent at once (the parent axis broadcast): [..., n, K parent, K child]
        scores = selector.scores(gated.unsqueeze(-2), top_values.unsqueeze(-2), candidates.unsqueeze(-2), parents)
        table = torch.log_softmax(scores, dim=-1)
    return torch.cat([candidates.to(table.dtype).unsqueeze(-2), table], dim=-2)  # [..., n, 1 + K, K]


def lattice_lists(host: torch.Tensor) -> tuple[list[list[int]], list[list[list[float]]]]:
    """(candidates [n][K], log_probs [n][K][K]) from a ``lattice_table`` already on the host."""
    return host[:, 0].long().tolist(), host[:, 1:].tolist()


__all__ = ["DFlash2CandidateSelector", "DraftVocabHead", "SelectorWalk", "lattice_lists", "lattice_table", "linear_head"]
