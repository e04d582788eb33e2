"""Stage 7, several processes: what makes N ranks train exactly what one process does.

    accelerate launch --multi_gpu --num_processes N -m dflash2_tools.train ...   # GPUs, or gloo on a CPU-only machine

A global batch is ``N * --batch-size`` sequences, cut into N rank batches (``batches.batch_indices``).
Three things keep N ranks on the one-process trajectory, up to the order of float sums:

* every sequence's random anchors come from a generator seeded by (seed, step, sequence index), never by rank;
* every loss term is divided by its weight summed over ALL ranks, so the gradients summed over ranks are the
  one-process gradients of the global batch (a mean of per-rank means would weigh a rank holding short
  sequences as much as one holding long ones);
* gradients are summed over ranks after backward in ONE flattened all-reduce, and the CPU time that drives the
  schedule is the ranks' mean, so every rank steps with the same learning rate and stops at the same step.

Why not DDP: the loss calls the drafter's block embedding, heads and selector outside its ``forward``, which a
DDP wrapper neither exposes nor tracks. With one process every function here is the identity, with no collective.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist


def sequence_generators(seed: int, step: int, idx: list[int]) -> list[torch.Generator]:
    """One generator per sequence of the batch, seeded by (seed, step, sequence index): the same anchors on any rank."""
    return [torch.Generator().manual_seed(((seed * 1_000_003 + step) * 1_000_033 + int(i)) % 2**63) for i in idx]


class Ranks:
    """The collectives of a training step, for ``world`` processes (no-ops for one). ``device``: where a collective's
    tensors must sit (NCCL takes GPU tensors only; gloo, CPU ones); results come back where their input was."""

    def __init__(self, world: int, device: torch.device | str = "cpu"):
        self.world, self.device = world, torch.device(device)
        if world > 1 and not dist.is_initialized():
            raise RuntimeError(f"{world} processes but no process group: launch with accelerate launch / torchrun")

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over ranks (a new tensor; gradients do not flow through it)."""
        if self.world == 1:
            return value.detach()
        total = value.detach().to(self.device, copy=True)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total.to(value.device)

    def sum_gradients(self, parameters) -> None:
        """Every parameter's gradient summed over ranks (a missing gradient counts as zeros)."""
        if self.world == 1:
            return
        params = [p for p in parameters if p.requires_grad]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])  # [n_params]
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        for p, part in zip(params, flat.split([p.numel() for p in params])):
            p.grad = part.view_as(p).clone()

    def broadcast_parameters(self, module: torch.nn.Module) -> None:
        """Rank 0's weights on every rank (the start of a run, fresh or resumed)."""
        if self.world == 1:
            return
        tensors = list(module.state_dict().values())
        flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])  # [n] (float64 holds every dtype used here)
        dist.broadcast(flat, src=0)
        with torch.no_grad():
            for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
                t.copy_(part.view_as(t).to(t.dtype))

    def any(self, marks: np.ndarray) -> np.ndarray:
        """A boolean array OR-ed over ranks (which feature-store sequences some rank has filled)."""
        if self.world == 1:
            return marks
        return self.sum(torch.from_numpy(marks.astype(np.int32))).numpy() > 0
