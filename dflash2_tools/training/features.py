"""Stage 3, features: what the frozen target contributes to training, computed once per sequence.

One target forward over (prompt + response) gives both
* the context features: hidden states of ``target_layer_ids``, concatenated -> [T, n*H];
* the teacher: the target's own next-token distribution at every position, kept as its top-k
  log-probabilities over the drafter's vocabulary (the draft vocabulary's columns when the
  drafter has one) -> [T, k] log-probs and [T, k] columns.

``FeatureStore`` keeps both on disk, memory-mapped, and fills them lazily: a sequence's rows are
written the first time a batch needs them, so the first epoch costs what online features cost
and every later epoch, and every later run on the same data (ablations), reads them back. What
is stored, per token: features as bf16 (4 layers x 576 x 2 B = 4.5 KiB for SmolLM2) and the
teacher as k float16 log-probs + k int32 columns (k=8: 48 B; the draft-vocabulary head behind it is ~4%
of the target forward, so a store always keeps it and distilling and plain runs share one store). The whole prompt is kept (the
drafter attends to all of it at inference; prompts here average ~100 tokens, so a cap would save
little and would train on a context the drafter never sees).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from .. import drafter as root
from .batches import collate, pad_stack


@torch.no_grad()
def target_forward(target, tokens, lengths, layer_ids, reduction=None, teacher_head=None, teacher_k: int = 0, logit_fn=None):
    """[b, T] ids -> (features [b, T, n*H], teacher log-probs [b, T, k] | None, teacher columns [b, T, k] | None).

    ``teacher_head``: the head the drafter drafts through (the target's, or its draft-vocabulary
    rows), applied to the target's final hidden state; ``logit_fn`` (the drafter's ``draft_logits``)
    adds the target's logit transforms. The teacher is normalised over that head's columns.
    """
    gen = root.generation()
    attention_mask = (torch.arange(tokens.shape[1], device=tokens.device)[None] < lengths[:, None].to(tokens.device)).long()
    T = tokens.shape[1]
    if not teacher_k:
        # logits_to_keep=1: the LM head over every position was a third of this forward (measured), and unused
        out = target(input_ids=tokens, attention_mask=attention_mask, output_hidden_states=[l + 1 for l in layer_ids], logits_to_keep=1)
        return gen.context_features(out.hidden_states, layer_ids, T, reduction), None, None
    # the base model's last_hidden_state is the final-normed state the LM head reads
    out = target.get_decoder()(input_ids=tokens, attention_mask=attention_mask, output_hidden_states=True)
    features = gen.context_features(out.hidden_states, layer_ids, T, reduction)  # [b, T, n*H]
    final = gen.reduce_streams(out.last_hidden_state, reduction)  # [b, T, H]
    logits = logit_fn(teacher_head, final).float()  # [b, T, V']
    logp, cols = torch.log_softmax(logits, dim=-1).topk(teacher_k, dim=-1)  # [b, T, k] each
    return features, logp, cols


def store_settings(target_name: str, layer_ids, reduction, bf16: bool, teacher_k: int, vocab_ids) -> str:
    """What every stored row depends on besides its own tokens: target, tapped layers, precision, teacher."""
    return json.dumps([target_name, list(layer_ids), reduction, bf16, teacher_k, list(vocab_ids or [])])


def store_key(target_name: str, layer_ids, reduction, bf16: bool, teacher_k: int, vocab_ids, sequences) -> str:
    """Fingerprint of a store: its settings and the token ids of every sequence, in order."""
    h = hashlib.sha256(store_settings(target_name, layer_ids, reduction, bf16, teacher_k, vocab_ids).encode())
    for tokens, _ in sequences:
        h.update(np.asarray(tokens, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


def sequence_digests(sequences) -> list[str]:
    """One fingerprint per sequence (its token ids): how a new store finds rows another store already holds."""
    return [hashlib.sha256(np.asarray(tokens, dtype=np.int64).tobytes()).hexdigest()[:24] for tokens, _ in sequences]


def _open_array(path: Path, dtype, shape):
    if path.exists():
        array = np.load(path, mmap_mode="r+")
        if array.shape != shape or array.dtype != dtype:
            raise SystemExit(f"{path} holds {array.dtype}{array.shape}, this data needs {np.dtype(dtype)}{shape}: delete the folder and rerun")
        return array
    return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)


class FeatureStore:
    """Features and teacher rows of a fixed list of sequences in ``folder``, memory-mapped and filled lazily.

    ``filled.npy`` marks complete sequences; it is written only after the arrays are flushed, so
    after an interruption at most the rows since the last ``flush`` are recomputed.
    """

    def __init__(self, folder: str | Path, lengths: list[int], width: int, teacher_k: int = 0,
                 settings: str | None = None, digests: list[str] | None = None):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        index = self.folder / "index.json"  # settings + per-sequence digests: lets later stores reuse these rows
        if settings is not None and digests is not None and not index.exists():
            index.write_text(json.dumps({"settings": settings, "width": width, "teacher_k": teacher_k,
                                         "lengths": [int(n) for n in lengths], "digests": digests}))
        self.settings, self.digests = settings, digests
        self.offsets = np.cumsum([0] + list(lengths))
        n_rows = int(self.offsets[-1])
        self.features = _open_array(self.folder / "features.npy", np.uint16, (n_rows, width))  # bf16 bits
        self.teacher_k = teacher_k
        if teacher_k:
            self.teacher_logp = _open_array(self.folder / "teacher_logp.npy", np.float16, (n_rows, teacher_k))
            self.teacher_cols = _open_array(self.folder / "teacher_cols.npy", np.int32, (n_rows, teacher_k))
        filled = self.folder / "filled.npy"
        self.filled = np.load(filled) if filled.exists() else np.zeros(len(lengths), dtype=bool)

    def missing(self, idx) -> list[int]:
        return [i for i in idx if not self.filled[i]]

    def write(self, i: int, features: torch.Tensor, logp: torch.Tensor | None = None, cols: torch.Tensor | None = None):
        """Rows of sequence ``i``: features [T_i, n*H], teacher [T_i, k]."""
        lo, hi = self.offsets[i], self.offsets[i + 1]
        self.features[lo:hi] = features.to(torch.bfloat16).cpu().view(torch.uint16).numpy()
        if self.teacher_k:
            self.teacher_logp[lo:hi] = logp.cpu().to(torch.float16).numpy()
            self.teacher_cols[lo:hi] = cols.cpu().to(torch.int32).numpy()
        self.filled[i] = True

    def read(self, i: int):
        """(features [T_i, n*H] bf16, teacher log-probs [T_i, k] fp32 | None, columns [T_i, k] long | None)."""
        lo, hi = self.offsets[i], self.offsets[i + 1]
        features = torch.from_numpy(np.ascontiguousarray(self.features[lo:hi])).view(torch.bfloat16)
        if not self.teacher_k:
            return features, None, None
        logp = torch.from_numpy(np.asarray(self.teacher_logp[lo:hi], dtype=np.float32))
        cols = torch.from_numpy(np.asarray(self.teacher_cols[lo:hi], dtype=np.int64))
        return features, logp, cols

    def flush(self, merge=None, write_marks: bool = True):
        """Arrays to disk, then the marks of complete sequences. Several processes fill one store, each its own
        sequences: ``merge`` ORs the marks over them (a collective: every rank calls it) and one writes them."""
        for array in (self.features, *((self.teacher_logp, self.teacher_cols) if self.teacher_k else ())):
            array.flush()
        if merge is not None:
            self.filled = merge(self.filled)
        if write_marks:
            tmp = self.folder / "filled.tmp.npy"
            np.save(tmp, self.filled)
            tmp.replace(self.folder / "filled.npy")

    def seed_from_siblings(self) -> int:
        """Copy the rows of every missing sequence that another store beside this one already holds (same settings,
        same tokens: same rows), so a new mix of known data costs target forwards only for its new sequences.
        Returns the number of sequences copied."""
        if self.settings is None or self.digests is None:
            return 0
        wanted = {d: i for i, d in enumerate(self.digests) if not self.filled[i]}
        copied = 0
        for index_path in sorted(self.folder.parent.glob("features-*/index.json")):
            other_folder = index_path.parent
            if not wanted or other_folder == self.folder:
                continue
            meta = json.loads(index_path.read_text())
            if (meta["settings"], meta["width"], meta["teacher_k"]) != (self.settings, self.features.shape[1], self.teacher_k):
                continue
            other = FeatureStore(other_folder, meta["lengths"], self.features.shape[1], self.teacher_k)
            hits = [(wanted.pop(d), j) for j, d in enumerate(meta["digests"]) if d in wanted and other.filled[j]]
            if not hits:
                continue
            for i, j in hits:
                lo, hi = self.offsets[i], self.offsets[i + 1]
                olo, ohi = other.offsets[j], other.offsets[j + 1]
                if ohi - olo != hi - lo:  # a digest collision would show here; recompute that sequence instead
                    continue
                self.features[lo:hi] = other.features[olo:ohi]
                if self.teacher_k:
                    self.teacher_logp[lo:hi] = other.teacher_logp[olo:ohi]
                    self.teacher_cols[lo:hi] = other.teacher_cols[olo:ohi]
                self.filled[i] = True
                copied += 1
            self.flush()
        return copied

    @property
    def fraction_filled(self) -> float:
        return float(self.filled.mean()) if len(self.filled) else 1.0


def features_for_batch(store: FeatureStore | None, idx, sequences, target, cfg, device, autocast, pad_id, head=None, teacher_k: int = 0):
    """Features [b, T, n*H] and teacher ((log-probs, columns) [b, T, k] each, or None) of sequences ``idx``.

    ``teacher_k`` applies online (0: no teacher); a store computes and returns the teacher it keeps.

    Without a store the target runs on the batch (online). With one, only sequences not yet
    stored run through the target (one batched forward); every row is then read back from the
    store, so a sequence trains on the same (bf16-rounded) features in every epoch.
    """
    k = teacher_k if store is None else store.teacher_k  # a store always keeps its teacher: runs share one store

    def run(indices):
        tokens, lengths, _ = collate([sequences[i] for i in indices], pad_id)
        with autocast():
            return target_forward(target, tokens.to(device), lengths.to(device), cfg.target_layer_ids, cfg.target_hidden_reduction,
                                  None if head is None else head.module, k, None if head is None else head.logit_fn), lengths

    if store is None:
        (features, logp, cols), _ = run(idx)
        return features, (None if logp is None else (logp, cols))
    missing = store.missing(idx)
    if missing:
        (features, logp, cols), lengths = run(missing)
        for row, i in enumerate(missing):
            L = int(lengths[row])
            store.write(i, features[row, :L], None if logp is None else logp[row, :L], None if cols is None else cols[row, :L])
    rows = [store.read(i) for i in idx]
    T = max(len(sequences[i][0]) for i in idx)
    features = pad_stack([r[0] for r in rows], T).to(device)  # [b, T, n*H] bf16
    if not store.teacher_k:
        return features, None
    return features, (pad_stack([r[1] for r in rows], T).to(device), pad_stack([r[2] for r in rows], T).to(device))
