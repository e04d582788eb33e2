"""The prepared GPU check runs on a CPU with tiny shapes (the smoke test CI runs), and its forced drafts commit exactly
the acceptance they are set to."""

from __future__ import annotations

import json

from dflash2_tools import gpu_check


def test_gpu_check_smoke_on_cpu(tmp_path):
    gpu_check.main(["--out", str(tmp_path), "--device", "cpu", "--tiny", "--accepts", "2", "4"])
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["checks"] and all(c["passed"] for c in result["checks"]), result["checks"]
    assert {c["check"].split()[1] for c in result["checks"] if c["check"].startswith("greedy")} >= {"llama", "qwen3", "glm5_next"}
    batched = [c["check"] for c in result["checks"] if "a batch of 4" in c["check"]]
    assert len(batched) == 4 and any("tree_budget=6 cache=static" in c for c in batched)  # paths and trees, both caches
    for row in result["step_costs"]:
        for accept, spec in row["speculative"].items():
            # every step commits exactly `accept` tokens, but the last (the length limit cuts it)
            assert int(accept) - 0.5 <= spec["tokens_per_forward"] <= int(accept), (row["target"], accept, spec)
            assert spec["same_as_target"] and spec["static_same_as_target"], (row["target"], accept, spec)  # fp32 on the CPU
    assert (tmp_path / "step_costs.png").stat().st_size > 0
