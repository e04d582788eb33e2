"""The prepared GPU check travels and runs: its file set (what the device machine gets: tracked files, untracked ones
git does not ignore, and the carried trimmed transformers wheel) stays well under the 64 MiB a device machine takes,
and its CPU smoke test runs FROM A COPY OF THAT FILE SET with the wheel's transformers; its forced drafts commit exactly
the acceptance they are set to."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from dflash2_tools import gpu_check

REPO = Path(__file__).resolve().parent.parent
LIMIT = 64 * 2**20  # what a device machine takes of the working tree, carried paths included
ROOM = 4 * 2**20  # room to spare for the next results and data


def travelling_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                         capture_output=True, check=True).stdout.decode()
    return [f for f in out.split("\0") if f and (REPO / f).is_file()]


def test_gpu_check_travels_and_its_smoke_test_runs_from_what_travels(tmp_path):
    wheel = gpu_check.write_wheel(tmp_path / "wheels")
    files = travelling_files()
    size = sum((REPO / f).stat().st_size for f in files) + wheel.stat().st_size
    assert size <= LIMIT - ROOM, f"{size / 2**20:.1f} MiB travel (limit {LIMIT / 2**20:.0f} MiB, {ROOM / 2**20:.0f} MiB spare)"

    tree = tmp_path / "tree"
    for f in files:  # exactly the file set a device machine gets
        (tree / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, tree / f)
    shutil.copytree(tmp_path / "wheels", tree / "wheels")
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
                    str(next((tree / "wheels").glob("transformers-*.whl")))], check=True)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{tree}", "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-m", "dflash2_tools.gpu_check", "--out", str(out), "--device", "cpu", "--tiny",
                    "--accepts", "2", "4"], cwd=tree, env=env, check=True)

    result = json.loads((out / "results.json").read_text())
    assert Path(result["transformers_path"]).is_relative_to(site)  # the wheel's transformers ran, not the venv's
    assert result["checks"] and all(c["passed"] for c in result["checks"]), result["checks"]
    assert {c["check"].split()[1].rstrip(",") for c in result["checks"] if c["check"].startswith("greedy")} >= {"llama", "qwen3", "glm5_next"}
    batched = [c["check"] for c in result["checks"] if "a batch of 4" in c["check"]]
    assert len(batched) == 5 and any("tree_budget=6 cache=static" in c for c in batched)  # paths and trees, both caches
    assert any(c.startswith("greedy glm5_next, a batch") for c in batched)  # a stateful target's batch
    for row in result["step_costs"]:
        for accept, spec in row["speculative"].items():
            # every step commits exactly `accept` tokens, but the last (the length limit cuts it)
            assert int(accept) - 0.5 <= spec["tokens_per_forward"] <= int(accept), (row["target"], accept, spec)
            assert spec["same_as_target"] and spec["static_same_as_target"], (row["target"], accept, spec)  # fp32 on the CPU
    assert (out / "step_costs.png").stat().st_size > 0
