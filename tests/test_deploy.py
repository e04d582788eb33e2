"""Deployment: official-format checkpoints in one line, engine config keys, Gemma-style embeddings, offloaded
and sharded targets (accelerate hooks, meta weights), attention backends decided before the first forward,
and step costs measured on the device."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import FREE_COSTS, VOCAB, root, tiny_drafter, tiny_target
from test_sampling import SAMPLES, _processors, _sample_counts, chi_square_p_value, exact_joint
from test_sampling import setup  # noqa: F401  (fixture: the sampling tests' flat target and far proposal)
from transformers import AutoModelForCausalLM
from transformers.dynamic_module_utils import get_class_from_dynamic_module
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging as hf_logging

from dflash2_tools.tiny_targets import tiny_glm5_next
from dflash2_tools.training.forward import multi_block_training_mask

QWEN3_KEYS = ("attention_bias", "attention_dropout", "bos_token_id", "eos_token_id", "pad_token_id", "head_dim", "hidden_act",
              "hidden_size", "initializer_range", "intermediate_size", "layer_types", "max_position_embeddings",
              "max_window_layers", "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "num_target_layers",
              "rms_norm_eps", "rope_parameters", "sliding_window", "tie_word_embeddings", "use_sliding_window", "vocab_size", "dtype")


def write_official(drafter, folder, **engine_keys):
    """``drafter`` as an official release writes it: Qwen3 hyperparameters, model_type qwen3, no auto_map, the
    nested dflash_config (plus engine keys), the same tensors."""
    drafter.save_pretrained(folder)
    ours = json.loads((folder / "config.json").read_text())
    official = {k: ours[k] for k in QWEN3_KEYS if k in ours}
    official.update(model_type="qwen3", architectures=["DFlash2DraftModel"], use_cache=False,
                    dflash_config={**ours["dflash_config"], **engine_keys})
    (folder / "config.json").write_text(json.dumps(official, indent=1))
    for path in folder.glob("*.py"):  # an official checkpoint ships no code of ours
        path.unlink()
    return folder


@pytest.fixture(scope="module")
def code_repo(tmp_path_factory):
    """This repository's remote code as a user reaches it (a Hub id online; a local folder offline)."""
    folder = tmp_path_factory.mktemp("repo")
    for name in root.REMOTE_CODE_FILES:
        shutil.copy(root.REPO_ROOT / name, folder / name)
    return folder


def load_official(code_repo, folder, **kw):
    """The README's one line."""
    return get_class_from_dynamic_module("modeling_dflash2.DFlash2DraftModel", str(code_repo)).from_pretrained(folder, **kw)


# ---- 1. the official checkpoint in one line ------------------------------------------------------------------


def test_official_checkpoint_one_line_greedy_equal_and_no_misleading_warning(tmp_path, code_repo):
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target, hybrid_ngram=None)
    folder = write_official(drafter, tmp_path / "official", use_swa=False, causal=False, sample_from_anchor=False, is_neox_style=True)
    logger = hf_logging.get_logger("transformers.configuration_utils")
    hf_logging.set_verbosity_warning()
    with CaptureLogger(logger) as captured:
        loaded = load_official(code_repo, folder).eval()
    assert "to instantiate a model of type" not in captured.out, captured.out
    assert loaded.config.model_type == "dflash2" and loaded.config.target_layer_ids == drafter.config.target_layer_ids
    for a, b in zip(loaded.state_dict().values(), drafter.state_dict().values()):
        assert torch.equal(a, b)
    g = torch.Generator().manual_seed(3)
    for n, new in ((1, 9), (5, 20), (12, 31)):
        ids = torch.randint(0, VOCAB - 2, (1, n), generator=g)
        want = target.generate(ids, max_new_tokens=new, do_sample=False)
        assert torch.equal(target.generate(ids, assistant_model=loaded, max_new_tokens=new, do_sample=False), want)


def test_official_checkpoint_sampling_is_exact(setup, tmp_path, code_repo):  # noqa: F811
    target, drafter, prompt = setup
    loaded = load_official(code_repo, write_official(drafter, tmp_path / "official")).eval()
    expected = exact_joint(target, prompt, _processors(1.0, 1.0, 1.0))
    counts = _sample_counts(target, loaded, prompt, dict(temperature=1.0, top_k=0, pad_token_id=0), SAMPLES)
    assert chi_square_p_value(counts, expected, SAMPLES) > 1e-3


# ---- 2. engine config keys -----------------------------------------------------------------------------------


def test_engine_keys_map_onto_the_config():
    C = root.config_class()
    base = dict(hidden_size=48, num_attention_heads=6, num_hidden_layers=3, vocab_size=VOCAB)
    swa = C(**base, dflash_config={"use_swa": True, "swa_window_size": 64})
    assert swa.sliding_window == 64 and swa.layer_types == ["sliding_attention"] * 3
    assert C(**base, dflash_config={"sliding_window": 32}).sliding_window == 32  # LMDeploy's spelling
    assert C(**base, dflash_config={"causal": True}).is_causal
    assert C(**base, dflash_config={"causal": True}).dflash_config["causal"] is True  # written back for the engines
    assert "causal" not in C(**base).dflash_config
    assert C(**base, dflash_config={"num_target_layers": 7}).num_target_layers == 7
    for harmless in ({"sample_from_anchor": False}, {"is_neox_style": True}, {"attention_sink_bias": False}, {"use_swa": False}):
        C(**base, dflash_config=harmless)


@pytest.mark.parametrize("key, value, words", [
    ("sample_from_anchor", True, "another model family"),
    ("is_neox_style", False, "interleaved"),
    ("attention_sink_bias", True, "attention-sink"),
    ("causal", "yes", "true or false"),
    ("swa_window_size", -5, "positive"),
])
def test_engine_keys_with_other_semantics_are_refused_by_name(key, value, words):
    C = root.config_class()
    with pytest.raises(ValueError, match=rf"dflash_config\['{key}'\].*{words}"):
        C(hidden_size=48, num_attention_heads=6, num_hidden_layers=3, vocab_size=VOCAB, dflash_config={key: value})


def test_conflicting_windows_and_unknown_keys_are_refused():
    C = root.config_class()
    with pytest.raises(ValueError, match="swa_window_size.*differs"):
        C(hidden_size=48, num_attention_heads=6, use_sliding_window=True, sliding_window=16, dflash_config={"swa_window_size": 64})
    with pytest.raises(ValueError, match="use_swa.*no sliding_attention"):
        C(hidden_size=48, num_attention_heads=6, num_hidden_layers=2, layer_types=["full_attention"] * 2,
          dflash_config={"use_swa": True, "swa_window_size": 8})
    with pytest.raises(ValueError, match=r"unknown keys \['frobnicate'\]"):
        C(hidden_size=48, num_attention_heads=6, dflash_config={"frobnicate": 1})


def test_causal_key_gives_a_causal_block():
    """causal: block position k does not see later block positions (the drafter's output there is unchanged when
    they change); the default block is non-causal (it does)."""
    feats = torch.randn(1, 4, 3 * 48)
    noise = torch.randn(1, 5, 48)
    later = noise.clone()
    later[:, 3:] += 1.0
    for causal in (True, False):
        d = tiny_drafter(target_layer_ids=[0, 3, 6], dflash_config={"causal": causal})
        a = d(noise_embeds=noise, context_hidden_states=feats).last_hidden_state
        b = d(noise_embeds=later, context_hidden_states=feats).last_hidden_state
        assert torch.allclose(a[:, :3], b[:, :3]) == causal
    mask = multi_block_training_mask(torch.tensor([[2, 6]]), 3, 8, causal=True)[0, 0]  # [6, 8 + 6]
    assert mask[0, 8:].tolist() == [True, False, False, False, False, False]
    assert mask[2, 8:].tolist() == [True, True, True, False, False, False]


def test_window_from_engine_keys_equals_the_top_level_window():
    feats = torch.randn(1, 12, 3 * 48)
    noise = torch.randn(1, 5, 48)
    engine = tiny_drafter(target_layer_ids=[0, 3, 6], dflash_config={"use_swa": True, "swa_window_size": 6})
    top = tiny_drafter(target_layer_ids=[0, 3, 6], use_sliding_window=True, sliding_window=6)
    full = tiny_drafter(target_layer_ids=[0, 3, 6])
    out = [m(noise_embeds=noise, context_hidden_states=feats).last_hidden_state for m in (engine, top, full)]
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=0)
    assert not torch.allclose(out[0], out[2])  # the window masks the oldest context


def test_gemma_style_target_block_inputs_are_raw_rows_times_input_embedding_scale():
    """A target whose embedding module scales its output (Gemma's embed_scale): the engines feed the raw rows times
    ``input_embedding_scale``, so the factor is applied once, not twice."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("gemma3_text", vocab_size=VOCAB, hidden_size=48, intermediate_size=72, num_hidden_layers=4,
                               num_attention_heads=6, num_key_value_heads=2, head_dim=8, sliding_window=16,
                               max_position_embeddings=512, pad_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, bos_token_id=0)
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(4.0)
    embed = target.get_input_embeddings()
    scale = float(embed.embed_scale)
    drafter = tiny_drafter(target, target_layer_ids=[0, 1, 3], input_embedding_scale=scale)
    ids = torch.tensor([[3, 7, 11]])
    torch.testing.assert_close(drafter.embed_block(embed, ids), embed.weight[ids] * scale)
    assert not torch.allclose(drafter.embed_block(embed, ids), embed(ids) * scale)  # the module's own output is scaled
    g = torch.Generator().manual_seed(2)
    for n in (1, 6):
        prompt = torch.randint(1, VOCAB - 2, (1, n), generator=g)
        want = target.generate(prompt, max_new_tokens=24, do_sample=False)
        assert torch.equal(target.generate(prompt, assistant_model=drafter, max_new_tokens=24, do_sample=False), want)


# ---- 3. offloaded and sharded targets ------------------------------------------------------------------------


def offloaded(model, tmp_path, disk_layers, embed="cpu"):
    """``model`` saved and reloaded with a device_map that puts its last ``disk_layers`` decoder layers and its LM head
    (and the embedding, with ``embed="disk"``) on disk: accelerate hooks, weights on meta until a module's forward."""
    model.save_pretrained(tmp_path / "weights")
    n_layers = model.config.get_text_config().num_hidden_layers
    layers_path = next(name for name, m in model.named_modules()
                       if isinstance(m, torch.nn.ModuleList) and name.endswith("layers") and len(m) == n_layers and "visual" not in name)
    device_map = {}

    def assign(prefix, module):
        for name, child in module.named_children():
            path = prefix + name
            if path == layers_path:
                device_map.update({f"{path}.{i}": "disk" if i >= n_layers - disk_layers else "cpu" for i in range(n_layers)})
            elif layers_path.startswith(path + "."):
                assign(path + ".", child)
            elif child is model.get_output_embeddings():
                device_map[path] = "disk"
            elif child is model.get_input_embeddings():
                device_map[path] = embed
            else:
                device_map[path] = "cpu"

    assign("", model)
    out = type(model).from_pretrained(tmp_path / "weights", device_map=device_map, offload_folder=str(tmp_path / "offload"),
                                      dtype=torch.float32).eval()
    on_meta = {name.rsplit(".", 1)[0] for name, p in out.named_parameters() if p.device.type == "meta"}
    assert f"{layers_path}.{n_layers - 1}.mlp" in on_meta or any(n.startswith(f"{layers_path}.{n_layers - 1}") for n in on_meta)
    return out


def test_offloaded_llama_target_both_modes(tmp_path, monkeypatch):
    target = tiny_target("llama")
    dispatched = offloaded(target, tmp_path, disk_layers=3, embed="disk")
    assert dispatched.get_input_embeddings().weight.device.type == "meta"
    drafter = tiny_drafter(target, draft_vocab_ids=list(range(0, VOCAB, 2)))
    g = torch.Generator().manual_seed(4)
    for budget in (None, 6):
        monkeypatch.setattr(drafter.config, "tree_budget", budget)
        for n in (1, 9):
            ids = torch.randint(0, VOCAB - 2, (1, n), generator=g)
            want = dispatched.generate(ids, max_new_tokens=20, do_sample=False)
            assert torch.equal(want, target.generate(ids, max_new_tokens=20, do_sample=False))
            got, stats = root.generation().dflash2_generate(dispatched, drafter, ids, max_new_tokens=20, do_sample=False)
            assert torch.equal(got, want)
            assert stats.mode == ("linear" if budget is None else f"tree-{budget}")


def test_offloaded_glm5_next_linear_and_tree_refused_up_front(tmp_path, monkeypatch):
    target = tiny_glm5_next()
    dispatched = offloaded(target, tmp_path, disk_layers=2)
    drafter = tiny_drafter(target, target_layer_ids=[0, 2, 4], target_hidden_reduction="mean", conv_group_size=8)
    for n in (1, 7):
        ids = torch.full((1, n), 11)
        want = dispatched.generate(ids, max_new_tokens=16, do_sample=False)
        got = dispatched.generate(ids, assistant_model=drafter, max_new_tokens=16, do_sample=False)
        assert torch.equal(got, want)
    monkeypatch.setattr(drafter.config, "tree_budget", 4)
    with pytest.raises(ValueError, match="stateful target"):
        dispatched.generate(torch.full((1, 3), 11), assistant_model=drafter, max_new_tokens=8, do_sample=False)


def test_offloaded_embedded_target_with_the_shipped_drafter_both_modes(tmp_path, monkeypatch):
    from dflash2_tools.target import embedded_target_dir

    target = AutoModelForCausalLM.from_pretrained(embedded_target_dir(), dtype=torch.float32).eval()
    dispatched = offloaded(target, tmp_path, disk_layers=10, embed="disk")  # tied: the head is the embedding, both on disk
    del target
    drafter = root.load_drafter(root.REPO_ROOT, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 9690, 198, 2683, 314, 253, 5356, 11173, 30, 2, 198, 1, 4093, 198]])  # a short chat prompt
    want = dispatched.generate(ids, max_new_tokens=24, do_sample=False)
    for budget in (None, 8):
        monkeypatch.setattr(drafter.config, "tree_budget", budget)
        assert torch.equal(dispatched.generate(ids, assistant_model=drafter, max_new_tokens=24, do_sample=False), want)


def test_placement_errors_name_the_fix():
    target = tiny_target("llama")
    drafter = tiny_drafter(target).to(torch.float64)
    with pytest.raises(ValueError, match=r"dtype.*drafter.to\(target.dtype\)"):
        target.generate(torch.tensor([[1, 2]]), assistant_model=drafter, max_new_tokens=4)
    meta = tiny_drafter(target).to("meta")
    with pytest.raises(ValueError, match="on meta.*load it whole"):
        target.generate(torch.tensor([[1, 2]]), assistant_model=meta, max_new_tokens=4)


# ---- 4. attention backends -----------------------------------------------------------------------------------


def test_tree_verification_on_a_flash_target_never_sends_the_tree_mask_to_flash(flash_stand_in, monkeypatch):
    target = tiny_target("qwen3")
    reference = [target.generate(torch.tensor([[5, 6, 7, 8][:n]]), max_new_tokens=18, do_sample=False) for n in (1, 4)]
    target.config._attn_implementation_internal = "flash_attention_2"
    drafter = tiny_drafter(target, tree_budget=6)
    for n, want in zip((1, 4), reference):
        ids = torch.tensor([[5, 6, 7, 8][:n]])
        assert torch.equal(target.generate(ids, max_new_tokens=18, do_sample=False), want)  # the stand-in is a faithful kernel
        before = len(flash_stand_in)
        got = target.generate(ids, assistant_model=drafter, max_new_tokens=18, do_sample=False)
        assert torch.equal(got, want)
        assert len(flash_stand_in) > before  # the prefill (and only causal work) went through "flash"
    assert target.config._attn_implementation == "flash_attention_2"  # restored after every verification


def test_drafter_on_flash_routes_masked_blocks_to_sdpa(flash_stand_in):
    d_flash = tiny_drafter(target_layer_ids=[0, 3, 6], attn_implementation="sdpa")
    d_flash.config._attn_implementation_internal = "flash_attention_2"
    d_sdpa = tiny_drafter(target_layer_ids=[0, 3, 6], attn_implementation="sdpa")
    feats, noise = torch.randn(1, 4, 3 * 48), torch.randn(1, 5, 48)
    padding = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1, 1]])  # one padded context key
    a = d_flash(noise_embeds=noise, context_hidden_states=feats, attention_mask=padding).last_hidden_state
    b = d_sdpa(noise_embeds=noise, context_hidden_states=feats, attention_mask=padding).last_hidden_state
    torch.testing.assert_close(a, b)
    calls = len(flash_stand_in)
    d_flash(noise_embeds=noise, context_hidden_states=feats)  # nothing masked: the flash kernel, non-causal
    assert len(flash_stand_in) == calls + 3


def test_sliding_window_and_static_cache_decided_before_any_forward(monkeypatch):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("qwen3", vocab_size=VOCAB, hidden_size=48, intermediate_size=72, num_hidden_layers=7,
                               num_attention_heads=6, num_key_value_heads=2, head_dim=8, use_sliding_window=True,
                               sliding_window=8, max_window_layers=0, pad_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    windowed = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    forwards = []
    windowed.register_forward_pre_hook(lambda *a: forwards.append(1))
    drafter = tiny_drafter(windowed, tree_budget=5)
    with pytest.raises(ValueError, match="8-token sliding window.*tree_budget = None"):
        windowed.generate(torch.tensor([[1, 2, 3]]), assistant_model=drafter, max_new_tokens=8, do_sample=False)
    assert not forwards  # refused up front

    target = tiny_target("llama")
    forwards = []
    handle = target.register_forward_pre_hook(lambda *a: forwards.append(1))
    tree = tiny_drafter(target, tree_budget=5)
    with pytest.raises(ValueError, match="offloaded cache is not supported.*cache_implementation=\"static\""):
        target.generate(torch.tensor([[1, 2, 3]]), assistant_model=tree, max_new_tokens=8, cache_implementation="offloaded")
    assert not forwards
    handle.remove()


def test_tree_mode_on_a_static_cache_is_greedy_equal(accepting):
    """Static cache in tree mode: the tree forward attends over every slot (stale ones masked), compaction moves the
    accepted nodes into place and sets the layer's length in place; the tree shrinks to the slots left."""
    target, trained, prompts = accepting
    g = torch.Generator().manual_seed(0)
    cases = [(torch.tensor([p]), new) for p in prompts[:2] for new in (5, 37)]
    cases += [(torch.randint(0, VOCAB - 2, (1, n), generator=g), new) for n, new in ((1, 9), (9, 33))]
    accepted = 0
    for budget in (3, 12):
        drafter = tiny_drafter(target, tree_budget=budget, seed=1)
        for model in (drafter, trained):
            model.config.tree_budget = budget
            for ids, new in cases:
                want = target.generate(ids, max_new_tokens=new, do_sample=False)
                got, stats = root.generation().dflash2_generate(target, model, ids, max_new_tokens=new, do_sample=False,
                                                                cache_implementation="static")
                assert torch.equal(got, want) and stats.mode == f"tree-{budget}"
                accepted += stats.accepted
    trained.config.tree_budget = None
    assert accepted > 20  # long acceptances went through the static compaction


def test_auto_tree_budget_falls_back_to_one_path_where_a_tree_cannot_be_exact():
    target = tiny_glm5_next()
    drafter = tiny_drafter(target, target_layer_ids=[0, 2, 4], target_hidden_reduction="mean", conv_group_size=8, tree_budget="auto")
    ids = torch.full((1, 4), 9)
    got, stats = root.generation().dflash2_generate(target, drafter, ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(got, target.generate(ids, max_new_tokens=10, do_sample=False)) and stats.mode == "linear"


# ---- 5. step costs measured on the device --------------------------------------------------------------------


def test_fit_costs_recovers_a_linear_cost_model():
    fit = root_costs().fit_costs(t1=0.010, t2=0.016, tn=0.024, n=10, draft=0.003)
    # t(n)/t(1) = 1 + m + p (n - 1): 1.6 at n=2, 2.4 at n=10 -> p = 0.1, m = 0.5
    assert fit == {"multi_token_step": pytest.approx(0.5), "per_token": pytest.approx(0.1), "draft": pytest.approx(0.3)}


def test_a_measured_cost_curve_is_what_the_rule_prices():
    """Measured widths are priced as measured (not by a line through two of them), between them interpolated, past
    the last extended along the last segment; a measurement's curve never goes down and reaches the rule."""
    ngram = root._sibling("ngram_dflash2")
    curve = ((1, 1.0), (2, 1.09), (4, 1.53), (8, 1.77), (17, 2.17))
    costs = ngram.StepCosts(0.0, 0.2285, 0.33, curve)
    assert costs.verify(0) == 1.0 and costs.verify(1) == pytest.approx(1.09) and costs.verify(3) == pytest.approx(1.53)
    assert costs.verify(5) == pytest.approx(1.53 + 0.24 * 2 / 4) and costs.verify(16) == pytest.approx(2.17)
    assert costs.verify(25) == pytest.approx(2.17 + 0.4 / 9 * 9)
    assert ngram.StepCosts(0.0, 0.2285, 0.33).verify(12) == pytest.approx(1 + 0.2285 * 12)  # the line: 3.7, not 2.2
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    measured = root_costs().measure_step_costs(target, drafter, drafter.draft_head(target.get_output_embeddings()), torch.device("cpu"))
    widths, prices = zip(*measured["curve"])
    assert widths[0] == 1 and prices[0] == 1.0 and list(prices) == sorted(prices) and 33 in widths
    assert root_costs().rule_costs(measured)["curve"] == tuple((int(w), float(c)) for w, c in measured["curve"])
    with pytest.raises(Exception, match="widths increasing"):  # @strict wraps the ValueError
        tiny_drafter(target, hybrid_ngram={"costs": {**FREE_COSTS, "curve": [[4, 1.5], [2, 1.1]]}})
    # a stateful target (linear-attention layers cannot crop back to the context) is measured too, not the table
    stateful = tiny_glm5_next()
    glm_drafter = tiny_drafter(stateful, target_layer_ids=[0, 2, 4], target_hidden_reduction="mean", conv_group_size=8,
                               hybrid_ngram={"costs": "measured"})
    for rows in (1, 2):
        costs, source = root_costs().step_costs(stateful, glm_drafter, None, torch.device("cpu"), rows)
        assert source.startswith("measured") and "error" not in costs and len(costs["curve"]) == 7


def root_costs():
    return root._sibling("costs_dflash2")


def test_costs_are_measured_once_per_machine_and_reported(monkeypatch, tmp_path):
    costs_module = root_costs()
    target = tiny_target("llama")
    drafter = tiny_drafter(target, hybrid_ngram={"costs": "measured"})
    calls = []
    real = costs_module.measure_step_costs
    monkeypatch.setenv("DFLASH2_COST_CACHE", str(tmp_path / "step_costs.json"))
    monkeypatch.setattr(costs_module, "_MEASURED", {})
    monkeypatch.setattr(costs_module, "measure_step_costs", lambda *a: calls.append(1) or real(*a))
    gen = root.generation()
    stats = [gen.dflash2_generate(target, drafter, torch.tensor([[1, 2, 3]]), max_new_tokens=6, do_sample=False)[1] for _ in range(2)]
    assert len(calls) == 1
    assert stats[0].costs["source"] == "measured" and stats[0].costs == stats[1].costs
    assert stats[0].costs["one_token_ms"] > 0 and min(stats[0].costs[k] for k in ("multi_token_step", "per_token", "draft")) >= 0
    monkeypatch.setattr(costs_module, "_MEASURED", {})  # a new process on the same machine: read from disk
    _, again = gen.dflash2_generate(target, drafter, torch.tensor([[1, 2, 3]]), max_new_tokens=6, do_sample=False)
    assert len(calls) == 1 and again.costs == stats[0].costs
    monkeypatch.setenv("DFLASH2_COST_CACHE", "")  # off: measured again
    monkeypatch.setattr(costs_module, "_MEASURED", {})
    gen.dflash2_generate(target, drafter, torch.tensor([[1, 2, 3]]), max_new_tokens=6, do_sample=False)
    assert len(calls) == 2
    calls.pop()
    configured = tiny_drafter(target, hybrid_ngram={"costs": FREE_COSTS})
    _, st = gen.dflash2_generate(target, configured, torch.tensor([[1, 2, 3]]), max_new_tokens=6, do_sample=False)
    assert st.costs == {**FREE_COSTS, "source": "config"} and len(calls) == 1
    # the default: measured on every device and dtype (an fp32 CPU too); "table" asks for the per-device table
    _, st = gen.dflash2_generate(target, tiny_drafter(target, hybrid_ngram=None), torch.tensor([[1, 2, 3]]), max_new_tokens=6, do_sample=False)
    assert st.costs["source"] == "measured" and len(calls) == 1  # this process measured this pair already
    c, source = costs_module.step_costs(target.to(torch.bfloat16), tiny_drafter(target, hybrid_ngram=None).to(torch.bfloat16), None, torch.device("cpu"))
    assert source == "measured" and len(calls) == 2
    _, source = costs_module.step_costs(target.float(), tiny_drafter(target, hybrid_ngram={"costs": "table"}), None, torch.device("cpu"))
    assert source == "table" and len(calls) == 2


# ---- 7. the demo says what holds --------------------------------------------------------------------------------


def test_demo_checks_exactness_in_fp32_and_says_where_bf16_parts():
    from dflash2_tools.demo import exactness_line, first_difference

    target = tiny_target("llama").to(torch.bfloat16)
    drafter = tiny_drafter(target).to(torch.bfloat16)
    inputs = {"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    kw = dict(do_sample=False, max_new_tokens=12)
    plain = target.generate(**inputs, **kw)
    parted = plain.clone()
    parted[0, 5] = (parted[0, 5] + 1) % VOCAB  # a bf16 run whose text parts at generated token 2
    line = exactness_line(target, drafter, inputs, parted, plain, "bfloat16", kw, {})
    assert "in bf16 the texts part at token 2" in line and "in fp32 (exact): yes" in line
    assert target.dtype == torch.bfloat16 and next(drafter.parameters()).dtype == torch.bfloat16  # restored
    assert first_difference(plain, plain, 3) is None and "identical in bf16" in exactness_line(target, drafter, inputs, plain, plain, "bfloat16", kw, {})
    assert exactness_line(target, drafter, inputs, plain, plain, "float32", kw, {}).endswith("yes")


@pytest.mark.parametrize("costs", ["free", "cpu"])
def test_one_path_per_step_on_a_static_cache_is_greedy_equal(accepting, costs):
    """transformers' assisted loop refuses static caches; with a DFlash 2 drafter the tree loop runs the hybrid rule's
    one-path proposals (block draft, n-gram, plain steps) as one-branch trees there."""
    from conftest import CPU_FP32_COSTS

    target, trained, prompts = accepting
    saved = trained.config.hybrid_ngram
    trained.config.hybrid_ngram = {**(saved or {}), "costs": FREE_COSTS if costs == "free" else CPU_FP32_COSTS}
    try:
        proposers, accepted = set(), 0
        for p in prompts[:3]:
            for new in (1, 6, 40):
                ids = torch.tensor([p])
                want = target.generate(ids, max_new_tokens=new, do_sample=False)
                got, stats = root.generation().dflash2_generate(target, trained, ids, max_new_tokens=new, do_sample=False,
                                                                cache_implementation="static")
                assert torch.equal(got, want) and stats.mode == "linear"
                proposers |= set(stats.proposers)
                accepted += stats.accepted
    finally:
        trained.config.hybrid_ngram = saved
    assert accepted > 20 and "dflash2-tree" not in proposers
    assert ("dflash2" if costs == "free" else "none") in proposers  # drafts verified / plain one-token steps taken


def test_one_path_on_a_static_cache_samples_exactly(setup):  # noqa: F811
    target, drafter, prompt = setup
    expected = exact_joint(target, prompt, _processors(0.7, 0.9, 1.3))
    counts = {}
    with root.generation().collect_stats() as runs:
        for seed in range(SAMPLES):
            torch.manual_seed(seed)
            out = target.generate(prompt, assistant_model=drafter, do_sample=True, max_new_tokens=3, temperature=0.7, top_p=0.9,
                                  top_k=0, repetition_penalty=1.3, pad_token_id=0, cache_implementation="static")
            cell = tuple(out[0, prompt.shape[1]:].tolist())
            counts[cell] = counts.get(cell, 0) + 1
    assert sum(r.drafted for r in runs) > 0 and all(r.mode == "linear" for r in runs)
    assert chi_square_p_value(counts, expected, SAMPLES) > 1e-3
