"""Several processes for real: `accelerate launch --multi_gpu --num_processes 2` (gloo on this CPU-only machine) trains
what one process trains at the same global batch, resumes across process counts, fills one feature store, and
regenerates every chunk exactly once.

These are the commands of docs/training.md's GPU node with only the device and the sizes changed. (`--cpu
--num_processes 2` is not used: accelerate then starts ONE process, multi-CPU being an mpirun setup.)
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import VOCAB, root, tiny_target, tiny_target_folder
from dflash2_tools import train
from dflash2_tools.regenerate import load_chunks
from dflash2_tools.training.batches import batch_indices

pytestmark = pytest.mark.skipif(not shutil.which("accelerate", path=str(Path(sys.executable).parent)), reason="accelerate CLI missing")

# float sums in another order (two partial batches + an all-reduce) are the only difference from one process:
# measured ~1e-7 relative on the loss; 4 AdamW steps keep the weights within 1e-5
LOSS_RTOL, WEIGHT_ATOL = 1e-5, 1e-4


def launch_two(module: str, args: list[str]) -> None:
    """``accelerate launch --multi_gpu --num_processes 2 -m module args`` with this interpreter, on a free port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port), "-m", module, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def trajectory(run: Path) -> list[tuple[int, int, float]]:
    return [(r["step"], r["tokens_seen"], r["loss"]) for r in map(json.loads, (run / "log.jsonl").read_text().splitlines())]


def assert_same_run(a: Path, b: Path):
    ta, tb = trajectory(a), trajectory(b)
    assert [t[:2] for t in ta] == [t[:2] for t in tb]  # the same steps, the same tokens counted
    for (step, _, la), (_, _, lb) in zip(ta, tb):
        assert la == pytest.approx(lb, rel=LOSS_RTOL), step
    wa = root.load_drafter(a / "checkpoint", dtype=torch.float32).state_dict()
    wb = root.load_drafter(b / "checkpoint", dtype=torch.float32).state_dict()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=WEIGHT_ATOL, rtol=0, msg=k)


def test_two_processes_train_what_one_does_share_the_feature_store_and_resume_across_process_counts(tmp_path):
    folder, data = tiny_target_folder(tmp_path)
    common = ["--target", str(folder), "--data", str(data), "--mask-token-id", str(VOCAB - 2), "--layers", "2", "--block-size", "4",
              "--blocks-per-seq", "4", "--max-steps", "4", "--eval-every", "1", "--eval-sequences", "2", "--save-every", "2",
              "--selector-rank", "8", "--selector-top-k", "4", "--heads", "6", "--kv-heads", "2", "--conv-group-size", "16",
              "--precision", "fp32", "--distill-weight", "1", "--teacher-k", "4"]  # every loss term, teacher from the store

    def run(name, batch, *extra):
        return common + ["--batch-size", str(batch), "--out", str(tmp_path / name), "--feature-cache-dir", str(tmp_path / f"store-{name}"),
                         *extra]

    train.main(run("one", 4))  # reference: one process, global batch 4, 4 steps (12 sequences: step 4 is a second epoch)
    # two processes x 2 sequences for 2 steps, then one process x 4 resumes (and reads the rows rank 1 stored)
    launch_two("dflash2_tools.train", run("two-then-one", 2, "--stop-after", "2"))
    (store,) = (tmp_path / "store-two-then-one").glob("features-*")
    lengths = [len(t) for t, _ in load_chunks(data)]
    seen = {i for step in range(2) for rank in range(2) for i in batch_indices(lengths, 2, step, 0, rank, 2)}
    assert set(np.flatnonzero(np.load(store / "filled.npy"))) == seen  # both ranks' sequences marked, by one writer
    train.main(run("two-then-one", 4))
    assert_same_run(tmp_path / "one", tmp_path / "two-then-one")
    # and the other way: one process for 2 steps, two processes resume
    train.main(run("one-then-two", 4, "--stop-after", "2"))
    launch_two("dflash2_tools.train", run("one-then-two", 2))
    assert_same_run(tmp_path / "one", tmp_path / "one-then-two")


def test_regenerate_under_two_processes_writes_every_chunk_once(tmp_path):
    from dflash2_tools.drafter import REPO_ROOT

    target = tmp_path / "target"
    tiny_target(vocab=49152, hidden=24, layers=2).save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # the real SmolLM2 tokenizer
        shutil.copy(REPO_ROOT / name, target / name)
    common = ["--target", str(target), "--limit", "300", "--max-new-tokens", "3", "--batch-size", "32", "--dtype", "float32"]
    launch_two("dflash2_tools.regenerate", common + ["--out", str(tmp_path / "two")])
    from dflash2_tools import regenerate

    regenerate.main(common + ["--out", str(tmp_path / "one")])
    names = sorted(p.name for p in (tmp_path / "one").glob("*.npz"))
    assert names == [f"chunk_{c:05d}.npz" for c in range(5)]  # 300 prompts: 4 full chunks of 64 and one of 44
    assert sorted(p.name for p in (tmp_path / "two").glob("*")) == sorted(names + ["meta.json"])  # no temporary file left
    one, two = load_chunks(tmp_path / "one"), load_chunks(tmp_path / "two")
    assert len(two) == len(one) > 200  # (prompts over the prompt budget are dropped, the same ones)
    for (t1, p1), (t2, p2) in zip(one, two):  # same prompts in the same chunks and order, the same greedy responses
        assert p1 == p2 and np.array_equal(t1, t2)
