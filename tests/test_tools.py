"""Data and reporting helpers: truncated JSON recovery, deterministic split, chunk storage, benchmark summary."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflash2_tools import benchmark, prompts
from dflash2_tools.regenerate import load_chunks, save_chunk


def test_truncated_json_list_recovers_complete_items():
    text = '[{"id": "a", "x": [1, 2]}, {"id": "b"},\n {"id": "c", "x": "cut he'
    assert [r["id"] for r in prompts.iter_truncated_json_list(text)] == ["a", "b"]
    assert [r["id"] for r in prompts.iter_truncated_json_list('[{"id": "a"}]')] == ["a"]


def test_dev_split_is_deterministic_and_small():
    ids = [f"conv-{i}" for i in range(5000)]
    dev = [i for i in ids if prompts.is_dev(i)]
    assert dev == [i for i in ids if prompts.is_dev(i)]
    assert 0.01 < len(dev) / len(ids) < 0.03


def test_jsonl_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi"}\n\n{"id": "x", "messages": [{"role": "user", "content": "yo"}]}\n')
    recs = prompts.load_prompt_set(str(path))
    assert recs[0]["messages"] == [{"role": "user", "content": "hi"}] and recs[1]["id"] == "x"


def test_chunks_roundtrip(tmp_path):
    save_chunk(tmp_path / "chunk_00000.npz", [[1, 2, 3], [4]], [[5, 6], [7, 8, 9]])
    save_chunk(tmp_path / "chunk_00001.npz", [[70000]], [[1]])  # ids past uint16 switch to int32
    seqs = load_chunks(tmp_path)
    assert [(t.tolist(), p) for t, p in seqs] == [([1, 2, 3, 5, 6], 3), ([4, 7, 8, 9], 1), ([70000, 1], 1)]
    assert np.load(tmp_path / "chunk_00000.npz")["tokens"].dtype == np.uint16


def test_chunks_from_several_folders_keep_the_first_folders_order(tmp_path):
    # a second folder (e.g. regenerated later with --offset) is appended: the first folder's
    # sequences keep their indices, so the index-based dev split of the old data does not move
    for folder, first in (("a", 0), ("b", 10)):
        (tmp_path / folder).mkdir()
        save_chunk(tmp_path / folder / f"chunk_{first + 1:05d}.npz", [[first + 2]], [[1]])
        save_chunk(tmp_path / folder / f"chunk_{first:05d}.npz", [[first + 1]], [[1]])
    seqs = load_chunks([tmp_path / "b", tmp_path / "a"])
    assert [int(t[0]) for t, _ in seqs] == [11, 12, 1, 2]
    assert [int(t[0]) for t, _ in load_chunks(str(tmp_path / "a"))] == [1, 2]
    # FOLDER@N: the first N chunks only (the same sequences while an engine keeps adding chunks)
    assert [int(t[0]) for t, _ in load_chunks([f"{tmp_path / 'b'}@1", tmp_path / "a"])] == [11, 1, 2]
    with pytest.raises(SystemExit, match="does not exist"):
        load_chunks(tmp_path / "missing")


def test_benchmark_summary_and_table():
    runs = []
    for pid, (t_base, t_spec) in enumerate([(10.0, 20.0), (10.0, 30.0), (20.0, 20.0)]):
        common = dict(dtype="bfloat16", temperature=0.0, prompt_set="s", prompt_id=str(pid), peak_rss_mb=100.0,
                      step_ms=10.0 + pid, step_target_forward_ms=7.0, step_draft_ms=2.0, step_overhead_ms=1.0 + pid)
        runs.append(dict(common, method="target", tok_per_s=t_base, acceptance_length=1.0, same_as_target=True))
        runs.append(dict(common, method="dflash2", tok_per_s=t_spec, acceptance_length=3.0, same_as_target=pid != 2))
    rows = benchmark.summarize(runs)
    spec = next(r for r in rows if r["method"] == "dflash2")
    assert spec["median_speedup"] == 2.0 and spec["lossless"] == "2/3" and spec["median_tok_per_s"] == 20.0
    table = benchmark.markdown_table(rows)
    assert "| bfloat16 | 0 | s | dflash2 | 3 | 20.0 | 2.00x | 3.00 | 2/3 | 100 |" in table
    assert "| bfloat16 | 0 | s | dflash2 | 11.0 | 7.0 | 2.0 | 2.0 |" in benchmark.profile_table(rows)


def test_engine_ab_summary_pairs_each_batch():
    """bench_engine: medians per version, and after / before ratios taken batch by batch (the pairing is the point)."""
    from dflash2_tools import bench_engine

    def run(engine_ms, tok_per_s):
        return {"engine_ms": engine_ms, "tokens_per_forward": 2.0, "tok_per_s": tok_per_s}

    rows = [{"set": "s", "batch_size": 4, "batch": k, "before": run(b, 10.0), "after": run(a, t), "same_output": k != 2}
            for k, (b, a, t) in enumerate([(2.0, 1.0, 11.0), (4.0, 3.0, 12.0), (3.0, 3.0, 9.0)])]
    (summary,) = bench_engine.summarize(rows)
    assert summary["before_engine_ms"] == 3.0 and summary["after_engine_ms"] == 3.0  # the medians alone: no change
    assert summary["engine_ms_ratio"] == 0.75 and summary["speed_ratio"] == 1.1  # paired: 0.5, 0.75, 1.0 / 1.1, 1.2, 0.9
    assert summary["same_output"] == 2 and "| s | 4 | 3.00 -> 3.00 | 0.75x | 1.100x | 2.00 -> 2.00 | 2/3 |" in bench_engine.table([summary])


def test_benchmark_llamacpp_rows_are_measured_against_both_targets():
    runs = []
    for pid, (t_hf, t_cpp, t_cpp_spec) in enumerate([(10.0, 60.0, 30.0), (10.0, 80.0, 20.0), (20.0, 100.0, 100.0)]):
        common = dict(dtype="float32", temperature=0.0, prompt_set="s", prompt_id=str(pid), peak_rss_mb=100.0,
                      step_ms=1.0, step_target_forward_ms=float("nan"), step_draft_ms=float("nan"), step_overhead_ms=float("nan"))
        runs.append(dict(common, method="target", tok_per_s=t_hf, acceptance_length=1.0, same_as_target=True))
        runs.append(dict(common, method="llama.cpp", tok_per_s=t_cpp, acceptance_length=1.0))
        runs.append(dict(common, method="llama.cpp+dflash2", tok_per_s=t_cpp_spec, acceptance_length=2.0))
    rows = benchmark.summarize(runs)
    spec = next(r for r in rows if r["method"] == "llama.cpp+dflash2")
    assert spec["median_speedup"] == 3.0 and spec["median_speedup_vs_llamacpp"] == 0.5  # medians of per-prompt ratios
    assert spec["lossless"].startswith("n/a") and next(r for r in rows if r["method"] == "target")["median_speedup_vs_llamacpp"] is None
    assert "| float32 | s | llama.cpp+dflash2 | 30.0 | 0.50x | 2.00 |" in benchmark.llamacpp_table(rows)
    assert [r["method"] for r in rows] == ["target", "llama.cpp", "llama.cpp+dflash2"]


def test_benchmark_orders_short_draft_methods_after_the_full_block():
    names = ["dflash2-d10", "dflash2+ngram-k12", "dflash2", "target", "dflash2+ngram", "dflash2-d2", "pld", "dflash1"]
    assert sorted(names, key=benchmark.method_rank) == [
        "target", "pld", "dflash1", "dflash2", "dflash2+ngram", "dflash2-d2", "dflash2-d10", "dflash2+ngram-k12"]


def test_learning_curve_chains_consecutive_runs(tmp_path):
    import json

    from dflash2_tools import plots

    def log(path, rows):
        path.write_text("".join(json.dumps({"step": s, "tokens_seen": t, "loss": 1.0, "dev": {
            "acceptance_length_argmax": a, "acceptance_length_selector": a + 0.1, "top1_per_position": [0.5]}}) + "\n" for s, t, a in rows))

    log(tmp_path / "a.jsonl", [(100, 1000, 1.2), (200, 2000, 1.4)])
    log(tmp_path / "b.jsonl", [(50, 700, 1.5)])
    points = plots.learning_curve([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], tmp_path / "lc.png")
    assert [(p["step"], p["tokens_seen"], p["run"]) for p in points] == [(100, 1000, 0), (200, 2000, 0), (250, 2700, 1)]
    assert (tmp_path / "lc.png").stat().st_size > 0 and json.loads((tmp_path / "lc.json").read_text()) == points
    # runs that log their training CPU time also get a CPU-hours axis; consecutive runs add up
    def timed_log(path, rows):
        path.write_text("".join(json.dumps({"step": s, "tokens_seen": s * 10, "loss": None if c is None else 1.0,
                                            **({} if c is None else {"train_cpu_seconds": c}), "dev": {
            "acceptance_length_argmax": 1.1, "on_policy_acceptance_length_argmax": 1.2, "top1_per_position": [0.5]}}) + "\n"
            for s, c in rows))

    timed_log(tmp_path / "c.jsonl", [(0, None), (10, 1800.0), (20, 3600.0)])
    timed_log(tmp_path / "d.jsonl", [(0, None), (5, 7200.0)])
    points = plots.learning_curve([tmp_path / "c.jsonl", tmp_path / "d.jsonl"], tmp_path / "lc2.png")
    assert [p["cpu_hours"] for p in points] == [0.0, 0.5, 1.0, 1.0, 3.0]
    assert [p["on_policy_argmax"] for p in points] == [1.2] * 5


def test_draft_vocabulary_from_training_responses_only(tmp_path, capsys):
    """Most frequent RESPONSE tokens of the train split (never prompts, never the dev split), plus EOS."""
    import json

    from conftest import tiny_drafter

    from dflash2_tools import draft_vocab
    from dflash2_tools.training.data import DEV_EVERY, is_dev_sequence

    prompts_, responses = [], []
    for i in range(2 * DEV_EVERY):
        dev = is_dev_sequence(i)
        prompts_.append([100, 101, 102, 103])  # frequent, but prompt tokens
        responses.append([90, 90, 91] if dev else [10, 10, 10, 11, 11, 12 + (i % 3 == 0)])  # dev tokens 90/91
    (tmp_path / "data").mkdir()
    save_chunk(tmp_path / "data" / "chunk_00000.npz", prompts_, responses)
    folder = tmp_path / "drafter"
    tiny_drafter(selector_top_k=3, eos_token_id=7).save_pretrained(folder)
    draft_vocab.main(["--data", str(tmp_path / "data"), "--size", "3", "--drafter", str(folder)])
    report = json.loads(capsys.readouterr().out)
    config = json.loads((folder / "config.json").read_text())
    # counts 10 > 11 > 12 > 13 (12 + 1 on every third sequence): the top 3, plus EOS 7
    assert config["draft_vocab_ids"] == [7, 10, 11, 12]
    assert report["dev_coverage"] == 0.0 and 0.9 < report["train_coverage"] < 1.0
    draft_vocab.main(["--data", str(tmp_path / "data"), "--size", "0", "--drafter", str(folder)])
    assert json.loads((folder / "config.json").read_text()).get("draft_vocab_ids") is None


def test_regenerate_offset_extends_data_with_other_prompts_and_refuses_other_settings(tmp_path, monkeypatch):
    import random
    import shutil

    from dflash2_tools import regenerate
    from dflash2_tools.drafter import REPO_ROOT

    from conftest import tiny_target

    target_dir = tmp_path / "target"
    tiny_target(vocab=49152, hidden=24, layers=2).save_pretrained(target_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # the real SmolLM2 tokenizer
        shutil.copy(REPO_ROOT / name, target_dir / name)
    records = [{"messages": [{"role": "user", "content": f"prompt number {i}" + " more" * (i % 5)}]} for i in range(150)]
    monkeypatch.setitem(regenerate.TRAINING_PROMPT_SOURCES, "sharegpt-first-turns", lambda: [dict(r) for r in records])
    out = tmp_path / "data-b"
    common = ["--target", str(target_dir), "--out", str(out), "--max-new-tokens", "2", "--batch-size", "16"]
    regenerate.main(common + ["--offset", "64", "--limit", "64"])
    assert sorted(p.name for p in out.glob("*.npz")) == ["chunk_00001.npz"]  # chunk 0 belongs to the first folder
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] in ("float32", "bfloat16")  # "auto" is recorded as what it resolved to

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    shuffled = list(records)
    random.Random(0).shuffle(shuffled)  # regenerate's own order for --seed 0
    expected = sorted(tuple(regenerate.encode_prompt(tok, r["messages"])) for r in shuffled[64:128])
    got = sorted(tuple(t[:p].tolist()) for t, p in load_chunks(out))
    assert got == expected

    other = "bfloat16" if meta["dtype"] == "float32" else "float32"
    with pytest.raises(SystemExit, match="other settings"):
        regenerate.main(common + ["--offset", "64", "--limit", "64", "--dtype", other])
    with pytest.raises(SystemExit):
        regenerate.main(common + ["--offset", "10"])  # not a multiple of the chunk size


def test_data_stats_counts_loops_per_window():
    from dflash2_tools.data_stats import data_stats, repeated_ngram_flags

    assert repeated_ngram_flags([1, 2, 3, 4, 1, 2, 3, 4, 5], n=4).tolist() == [False, False, False, False, True, False]
    loop = np.array([9] * 3 + list(range(10, 18)) * 4)  # prompt [9, 9, 9], then an 8-token phrase 4 times
    fresh = np.array([9] * 3 + list(range(100, 132)))
    stats = data_stats([(loop, 3), (fresh, 3)], windows=((0, 16), (16, 32)))
    rep = stats["repeated_4gram_fraction"]
    assert rep["0-16"] == {"responses": 2, "fraction": round((5 / 13) / 2, 3)}  # loop: 4-grams at 8..12 of 0..12 repeat
    assert rep["16-32"] == {"responses": 2, "fraction": 0.5}  # loop: all repeats; fresh: none
    assert stats["sequences"] == 2 and stats["response_tokens"] == 64 and stats["share_at_max"] == 1.0


def test_every_human_turn_is_a_prompt_with_its_history(monkeypatch):
    convs = [
        {"id": "a", "conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
                                      {"from": "human", "value": "q2"}, {"from": "gpt", "value": "a2"},
                                      {"from": "human", "value": " "}, {"from": "human", "value": "q3"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "orphan answer"}, {"from": "human", "value": "q1"}]},
    ]
    monkeypatch.setattr(prompts, "sharegpt_conversations", lambda: convs)
    monkeypatch.setattr(prompts, "is_dev", lambda cid: False)
    records = prompts.sharegpt_turn_prompts("train")
    texts = [[m["content"] for m in r["messages"]] for r in records]
    # later turns first, then first turns; the empty turn is skipped; "q1" with no history is one prompt
    assert texts == [["q1", "a1", "q2"], ["q1", "a1", "q2", "a2", "q3"], ["q1"]]
    assert [r["turn"] for r in records] == [1, 2, 0]
    assert [m["role"] for m in records[1]["messages"]] == ["user", "assistant", "user", "assistant", "user"]


def test_trim_history_drops_the_oldest_exchanges_to_fit():
    messages = [{"role": r, "content": c} for r, c in [("user", "aaaa"), ("assistant", "bbbb"), ("user", "cc")]]
    encode = lambda ms: [len(m["content"]) for m in ms for _ in range(len(m["content"]))]  # 1 token per character
    assert len(prompts.trim_history(encode, messages, 10)) == 10  # everything fits
    assert prompts.trim_history(encode, messages, 9) == [2, 2]  # the oldest (question, answer) pair goes
    assert prompts.trim_history(encode, messages, 1) is None  # even the last question does not fit


def test_acceptance_history_fits_log_tokens_and_extrapolates_to_the_goal(tmp_path):
    from dflash2_tools import plots

    runs = []
    for i, (tokens, acc) in enumerate([(1_000_000, 1.5), (1_000_000, 1.75), (2_000_000, 2.0)]):  # cumulative 1M, 2M, 4M
        (tmp_path / f"log{i}.jsonl").write_text(json.dumps({"step": 1, "tokens_seen": tokens}) + "\n")
        runs.append({"name": f"run {i + 1}", "log": f"log{i}.jsonl", "plain_call_acceptance": acc})
    (tmp_path / "history.json").write_text(json.dumps({"runs": runs}))
    r = plots.acceptance_history(tmp_path / "history.json", tmp_path / "h.png", goal=3.0)
    assert r["cumulative_tokens"] == [1_000_000, 2_000_000, 4_000_000]
    assert r["fit_per_doubling"] == pytest.approx(0.25)  # +0.25 per doubling: 3.0 is 4 doublings after 4M
    assert r["tokens_for_goal_by_fit"] == pytest.approx(64_000_000)
    assert (tmp_path / "h.png").stat().st_size > 0


def test_per_set_history_fits_each_set_over_the_runs_that_measured_it(tmp_path):
    from dflash2_tools import plots

    runs = []
    for i, (tokens, code, math_) in enumerate([(1_000_000, None, None), (1_000_000, 1.5, 1.6), (2_000_000, 1.6, 1.6)]):
        (tmp_path / f"log{i}.jsonl").write_text(json.dumps({"step": 1, "tokens_seen": tokens}) + "\n")
        run = {"name": f"run {i + 1}", "log": f"log{i}.jsonl", "plain_call_acceptance": 2.0}
        if code is not None:  # the first run measured no set: it adds tokens, not points
            for name, value in (("code", code), ("math", math_)):
                (tmp_path / f"{name}{i}.json").write_text(json.dumps({"mean_acceptance_length": value}))
            run["per_set"] = {"code": f"code{i}.json", "math": f"math{i}.json"}
        runs.append(run)
    (tmp_path / "history.json").write_text(json.dumps({"runs": runs}))
    r = plots.per_set_history(tmp_path / "history.json", tmp_path / "p.png", {"code": 2.0, "math": 1.9})
    assert r["cumulative_tokens"] == [2_000_000, 4_000_000]
    assert r["sets"]["code"]["fit_per_doubling"] == pytest.approx(0.1)  # 1.6 at 4M, +0.1 per doubling: 2.0 at 64M
    assert r["sets"]["code"]["tokens_for_goal_by_fit"] == pytest.approx(64_000_000)
    assert r["sets"]["math"]["tokens_for_goal_by_fit"] == float("inf")  # flat: no fit reaches the goal
    assert (tmp_path / "p.png").stat().st_size > 0
    many = {f"set{k}": 2.0 for k in range(7)}  # more sets than one colour list would hold: none may be dropped
    for run in runs[1:]:
        for name in many:
            run["per_set"][name] = run["per_set"]["code"]
    (tmp_path / "history.json").write_text(json.dumps({"runs": runs}))
    assert set(plots.per_set_history(tmp_path / "history.json", tmp_path / "p.png", many)["sets"]) == set(many)
    with pytest.raises(ValueError, match="too few for \\['ood'\\]"):
        plots.per_set_history(tmp_path / "history.json", tmp_path / "p.png", {"ood": 2.0})
    with pytest.raises(ValueError, match="SET=NUMBER"):
        plots.parse_goals(["humaneval:2.0"])
    assert plots.parse_goals(["humaneval=2.0", "champ=1.9"]) == {"humaneval": 2.0, "champ": 1.9}


def test_every_prompt_source_has_a_description_and_the_committed_folders_resume_under_it():
    """meta.json's ``prompt_set`` must equal today's description of its source, or resuming a folder is refused."""
    import re

    from dflash2_tools import regenerate
    from dflash2_tools.drafter import REPO_ROOT

    assert set(regenerate.PROMPT_SET_DESCRIPTIONS) == set(regenerate.TRAINING_PROMPT_SOURCES)
    unversioned = lambda text: re.sub(r"\d+(\.\d+)+", "N", text)  # noqa: E731 -- stub sources name library versions
    known = {unversioned(regenerate.prompt_set_description(name)) for name in regenerate.TRAINING_PROMPT_SOURCES}
    folders = sorted((REPO_ROOT / "data").glob("*/meta.json"))
    assert len(folders) >= 5
    for meta_path in folders:
        assert unversioned(json.loads(meta_path.read_text())["prompt_set"]) in known, meta_path


def test_acceptance_measures_greedy_and_sampled_calls(tmp_path):
    """``dflash2_tools.acceptance``: the block draft alone through the plain call, greedy (checked against the target)
    and sampled (``--temperature``: the same seeded draws for every drafter compared)."""
    import shutil

    from transformers import AutoTokenizer

    from conftest import tiny_drafter, tiny_target
    from dflash2_tools import acceptance
    from dflash2_tools.drafter import REPO_ROOT

    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # the real SmolLM2 tokenizer
        shutil.copy(REPO_ROOT / name, tmp_path / name)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    target = tiny_target(vocab=49152, layers=3)
    drafter = tiny_drafter(target)
    records = [{"messages": [{"role": "user", "content": "hello there, how are you?"}]}]
    greedy = acceptance.measure(target, tokenizer, drafter, records, max_new_tokens=8, check=True)
    assert greedy["greedy_mismatches"] == 0 and greedy["mean_acceptance_length"] >= 1.0
    sampled = [acceptance.measure(target, tokenizer, drafter, records, max_new_tokens=8, temperature=0.8) for _ in range(2)]
    assert sampled[0]["greedy_mismatches"] is None and sampled[0]["mean_acceptance_length"] >= 1.0
    assert sampled[0] == sampled[1]  # seeded per prompt: a comparison of drafters sees the same draws
