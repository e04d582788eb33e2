"""Host transfers per target forward through the public call: each one a device->host sync on a GPU.

    python -m dflash2_tools.host_transfers --budgets 0 8 64 --out docs/tree/host_transfers.json

Counts every call that moves a tensor's value to the host (``Tensor.item/tolist/__bool__/__int__/__float__/__index__/
numpy/cpu``) during ``target.generate(**inputs, assistant_model=drafter)`` on the embedded target with the shipped
drafter (fp32, one held-out ShareGPT-dev prompt), greedy and sampling with processors (temperature 0.8, top-p 0.9,
repetition penalty 1.2), one path per step (budget 0) and trees of 8 and 64 nodes, and divides by the target's
forwards. The count per forward should not grow with the tree's budget (the loop moves the tree's lattice and the
target's choices after every node to the host in one transfer each).
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch

HOST_TRANSFERS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu")


@contextlib.contextmanager
def count_host_transfers():
    """Yields a one-element list that counts host transfers while the context is open (patches ``torch.Tensor``)."""
    counts = [0]
    originals = {name: getattr(torch.Tensor, name) for name in HOST_TRANSFERS}

    def counted(original):
        def wrapper(self, *args, **kwargs):
            counts[0] += 1
            return original(self, *args, **kwargs)

        return wrapper

    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, counted(original))
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def transfers_per_forward(target, drafter, inputs: dict, **generate_kwargs) -> tuple[float, int]:
    """(host transfers per target forward, target forwards) of one public call."""
    forwards = [0]
    handle = target.register_forward_pre_hook(lambda *a: forwards.__setitem__(0, forwards[0] + 1))
    try:
        with count_host_transfers() as counts:
            target.generate(**inputs, assistant_model=drafter, **generate_kwargs)
    finally:
        handle.remove()
    return counts[0] / forwards[0], forwards[0]


SAMPLING = dict(do_sample=True, temperature=0.8, top_p=0.9, top_k=0, repetition_penalty=1.2)


def main(argv=None):
    from . import drafter as root
    from .prompts import load_prompt_set
    from .target import load_target

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", type=int, nargs="+", default=[0, 8, 64], help="tree nodes per step (0: one path)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--prompt-set", default="sharegpt-dev")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    target, tokenizer = load_target()
    drafter = root.load_drafter(dtype=target.dtype).eval()
    record = load_prompt_set(args.prompt_set)[0]
    inputs = tokenizer.apply_chat_template(record["messages"], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    rows = []
    for mode, kwargs in (("greedy", dict(do_sample=False)), ("sampling", SAMPLING)):
        for budget in args.budgets:
            drafter.config.tree_budget = budget or None
            torch.manual_seed(0)
            per_forward, forwards = transfers_per_forward(target, drafter, inputs, max_new_tokens=args.max_new_tokens, **kwargs)
            rows.append(dict(mode=mode, tree_budget=budget, transfers_per_forward=round(per_forward, 2), target_forwards=forwards))
            print(f"{mode:8s} budget {budget:3d}: {per_forward:6.2f} host transfers per target forward ({forwards} forwards)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(prompt_set=args.prompt_set, prompt_id=record["id"], max_new_tokens=args.max_new_tokens,
                                        sampling=SAMPLING, rows=rows), indent=1))


if __name__ == "__main__":
    main()
