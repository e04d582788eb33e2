"""The model card's numbers are generated from committed result files (``dflash2_tools.card``), and CI fails when the
README differs from what those files give."""

from __future__ import annotations

import json
import shutil

import pytest

from dflash2_tools import card


def test_the_readme_tables_equal_what_the_committed_results_give():
    assert card.main(["--check"]) == 0, "run: python -m dflash2_tools.card --write"


def test_a_changed_result_makes_the_check_fail(tmp_path):
    saved = json.loads(card.RESULTS.read_text())
    saved["summary"][0]["median_speedup"] += 0.5  # a number the README no longer shows
    changed = tmp_path / "results.json"
    changed.write_text(json.dumps(saved))
    readme = tmp_path / "README.md"
    shutil.copy(card.REPO / "README.md", readme)
    assert card.main(["--check", "--readme", str(readme), "--results", str(changed)]) == 1
    assert card.main(["--write", "--readme", str(readme), "--results", str(changed)]) == 0
    assert card.main(["--check", "--readme", str(readme), "--results", str(changed)]) == 0


def test_every_readme_row_is_a_benchmark_row_and_a_missing_block_is_named():
    saved = json.loads(card.RESULTS.read_text())
    block = card.results_block(saved)
    for row in saved["summary"]:
        if row["temperature"] == 0:
            assert f"{row['median_speedup']:.2f}x ({row['mean_acceptance_length']:.2f})" in block
    assert saved["machine"]["cpu"] in block  # the machine is named next to its numbers
    with pytest.raises(ValueError, match="card:results"):
        card.replace_blocks("no markers here", {"results": block})
