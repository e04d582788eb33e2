"""Training pipeline: loss pieces on tiny data, optimisation, export, exact resume."""

from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import VOCAB, greedy_sequences, root, tiny_drafter, tiny_target, tiny_target_folder

from dflash2_tools import train
from dflash2_tools.regenerate import load_chunks, save_chunk
from dflash2_tools.training import batches, features, forward, loop, model
from dflash2_tools.training import data as training_data
from dflash2_tools.training import loss as losses
from dflash2_tools.training.forward import multi_block_training_mask

STEP_ARGS = dict(blocks_per_seq=8, gamma=None, selector_weight=1.0, position_weighting="decay", chain_floor=0.1, distill_weight=0.0)


def test_position_weights():
    w = losses.position_weights(8)
    assert w.shape == (7,)
    torch.testing.assert_close(w, torch.exp(-torch.arange(7.0) / 4.0))
    torch.testing.assert_close(losses.position_weights(16)[1], torch.tensor(float(np.exp(-1 / 7))))


def test_anchor_sampling_stays_in_responses():
    g = torch.Generator().manual_seed(0)
    lengths, prompts = torch.tensor([20, 9, 6, 5]), torch.tensor([6, 3, 5, 5])
    anchors, valid = losses.sample_anchors(lengths, prompts, 4, g)
    for i in range(4):
        a = anchors[i][valid[i]]
        assert ((a >= prompts[i] - 1) & (a <= lengths[i] - 2)).all()
        assert len(set(a.tolist())) == len(a)  # distinct
    assert valid[0].all() and valid[1].all()
    assert valid[2].tolist() == [True, False, False, False] and anchors[2, 0] == 4  # one response token: one block
    assert not valid[3].any()  # no response at all: no block
    # fresh anchors for another step
    assert not torch.equal(anchors, losses.sample_anchors(lengths, prompts, 4, torch.Generator().manual_seed(1))[0])


def test_block_inputs_and_labels():
    tokens = torch.arange(100, 112)[None]  # [1, 12]
    ids, labels = losses.block_inputs(tokens, torch.tensor([12]), torch.tensor([[2, 8]]), torch.tensor([[True, True]]), 4, 99)
    assert ids.tolist() == [[102, 99, 99, 99, 108, 99, 99, 99]]
    assert labels.tolist() == [[[103, 104, 105], [109, 110, 111]]]
    _, labels = losses.block_inputs(tokens, torch.tensor([10]), torch.tensor([[2, 8]]), torch.tensor([[True, False]]), 4, 99)
    assert labels[0, 1].tolist() == [-100] * 3


def test_training_mask_semantics(modeling_module):
    m = multi_block_training_mask(torch.tensor([[2, 5]]), 3, 7)[0, 0]  # [6, 7 + 6]
    for q in range(6):
        block, anchor = divmod(q, 3)[0], (2, 5)[q // 3]
        assert m[q, :7].tolist() == [p < anchor for p in range(7)]
        assert m[q, 7:].tolist() == [k // 3 == block for k in range(6)]
    windowed = multi_block_training_mask(torch.tensor([[5]]), 3, 7, sliding_window=2)[0, 0]
    assert windowed[0, :7].tolist() == [False, False, False, False, True, False, False]


def test_block_cross_entropy_weights_and_ignore():
    logits = torch.zeros(1, 1, 3, 5)
    logits[0, 0, 0, 1] = 10.0  # position 1 right, others uniform
    labels = torch.tensor([[[1, 2, -100]]])
    w = torch.tensor([1.0, 0.5, 0.25])
    got = losses.block_cross_entropy(logits, labels, w)
    ce0 = torch.nn.functional.cross_entropy(logits[0, 0, :1], labels[0, 0, :1])
    ce1 = torch.log(torch.tensor(5.0))
    torch.testing.assert_close(got, (1.0 * ce0 + 0.5 * ce1) / 1.5)


def test_selector_loss_skips_tokens_outside_top_k():
    d = tiny_drafter(selector_top_k=3)
    hidden = torch.randn(1, 1, 4, 48)
    logits = torch.randn(1, 1, 4, VOCAB)
    top = logits.topk(3, -1).indices
    labels = torch.stack([top[0, 0, 0, 1], top[0, 0, 1, 0], torch.tensor(-100), top[0, 0, 3, 2]])[None, None]
    outside = int(torch.ones(VOCAB, dtype=torch.bool).scatter(0, top[0, 0, 2], False).nonzero()[0])
    labels[0, 0, 2] = outside
    loss, covered = losses.selector_cross_entropy(d.candidate_selector, hidden, logits, torch.tensor([[5]]), labels, torch.ones(4))
    assert torch.isfinite(loss) and covered == pytest.approx(3 / 4)


def test_acceptance_lengths():
    drafts = torch.tensor([[[1, 2, 3], [1, 9, 3], [7, 2, 3]]])
    labels = torch.tensor([[[1, 2, 3], [1, 2, 3], [1, 2, 3]]])
    assert losses.acceptance_lengths(drafts, labels).tolist() == [[4, 2, 1]]
    assert losses.expected_acceptance_from_rates([1.0, 0.5, 0.0]) == 2.5


def test_a_few_steps_lower_the_loss():
    target = tiny_target("llama")
    seqs = greedy_sequences(target, [[3, 4, 5], [9, 8, 7, 6]], max_new_tokens=30)
    drafter = tiny_drafter(target, randomize=False).train()
    args = SimpleNamespace(**STEP_ARGS)
    batch = batches.collate(seqs, pad_id=0)
    feats, _, _ = features.target_forward(target, batch[0], batch[1], drafter.config.target_layer_ids)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    head = forward.LossHead.of(drafter, target)

    def loss_at(seed):
        return forward.compute_loss(drafter, target, head, batch, feats, torch.Generator().manual_seed(seed), args)[0]

    with torch.no_grad():
        before = loss_at(0).item()
    for step in range(15):
        loss_at(step + 1).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        assert loss_at(0).item() < 0.7 * before


def test_stop_and_resume_equals_uninterrupted(tmp_path):
    folder, data = tiny_target_folder(tmp_path)
    assert len(load_chunks(data)) == 12
    common = ["--target", str(folder), "--data", str(data), "--mask-token-id", str(VOCAB - 2), "--layers", "2",
              "--block-size", "4", "--batch-size", "2", "--blocks-per-seq", "4", "--max-steps", "6", "--eval-every", "3",
              "--eval-sequences", "2", "--selector-rank", "8", "--selector-top-k", "4", "--heads", "6", "--kv-heads", "2",
              "--conv-group-size", "16", "--precision", "fp32"]
    # both runs store features (filled lazily, flushed with each checkpoint), each in its own folder;
    # run b is interrupted: its second half reads the rows its first half stored, and must equal run a
    train.main(common + ["--out", str(tmp_path / "a"), "--feature-cache-dir", str(tmp_path / "features-a")])
    on_disk = ["--feature-cache", "disk", "--feature-cache-dir", str(tmp_path / "features")]
    train.main(common + on_disk + ["--out", str(tmp_path / "b"), "--stop-after", "4", "--save-every", "2"])
    state = torch.load(tmp_path / "b" / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 4
    (store,) = list((tmp_path / "features").glob("features-*"))
    assert np.load(store / "filled.npy").any()
    train.main(common + on_disk + ["--out", str(tmp_path / "b"), "--save-every", "2"])  # same command resumes
    a = root.load_drafter(tmp_path / "a" / "checkpoint", dtype=torch.float32).state_dict()
    b = root.load_drafter(tmp_path / "b" / "checkpoint", dtype=torch.float32).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    log = [json.loads(line) for line in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [3, 6] and "acceptance_length_argmax" in log[-1]["dev"]


def test_warm_start_logs_its_baseline_and_eval_only_reproduces_it(tmp_path, capsys):
    folder, data = tiny_target_folder(tmp_path)
    common = ["--target", str(folder), "--data", str(data), "--mask-token-id", str(VOCAB - 2), "--layers", "2",
              "--block-size", "4", "--batch-size", "2", "--blocks-per-seq", "4", "--eval-sequences", "2",
              "--selector-rank", "8", "--selector-top-k", "4", "--heads", "6", "--kv-heads", "2", "--conv-group-size", "16",
              "--feature-cache", "online"]
    train.main(common + ["--out", str(tmp_path / "a"), "--max-steps", "3", "--eval-every", "3"])
    first = tmp_path / "a" / "checkpoint"
    train.main(common + ["--out", str(tmp_path / "c"), "--init-from", str(first), "--max-steps", "2", "--eval-every", "2"])
    log_a = [json.loads(line) for line in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    log_c = [json.loads(line) for line in (tmp_path / "c" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log_c] == [0, 2] and log_c[0]["loss"] is None
    assert log_c[0]["dev"] == log_a[-1]["dev"]  # the baseline IS the weights it started from
    capsys.readouterr()
    # the same data split over two folders (as regenerate --offset leaves it): the same dev split
    seqs = load_chunks(data)
    for name, part in (("part1", seqs[:5]), ("part2", seqs[5:])):
        (tmp_path / name).mkdir()
        save_chunk(tmp_path / name / f"chunk_{len(name):05d}.npz", [t[:p].tolist() for t, p in part], [t[p:].tolist() for t, p in part])
    two_folders = [a if a != str(data) else str(tmp_path / "part1") for a in common]
    two_folders.insert(two_folders.index("--data") + 2, str(tmp_path / "part2"))
    train.main(two_folders + ["--out", str(tmp_path / "d"), "--init-from", str(first), "--eval-only"])
    out = capsys.readouterr().out
    printed = json.loads(out.strip().splitlines()[-1])
    assert printed["dev"] == log_a[-1]["dev"] and not (tmp_path / "d" / "log.jsonl").exists()
    n_train = sum(1 for i, (t, p) in enumerate(seqs) if len(t) - p >= 2 and not training_data.is_dev_sequence(i))
    assert f"data: {n_train} train / " in out  # both folders were read
    # a drafter trained at block 4 verified at block 3: a shorter block, per-position figures for its 2 drafted slots
    train.main(common + ["--out", str(tmp_path / "e"), "--init-from", str(first), "--eval-only", "--eval-block-size", "3"])
    shorter = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["dev"]
    assert len(shorter["top1_per_position"]) == 2 and len(log_a[-1]["dev"]["top1_per_position"]) == 3
    assert shorter.keys() == log_a[-1]["dev"].keys()
    with pytest.raises(SystemExit, match="use 2..4"):
        train.main(common + ["--out", str(tmp_path / "e"), "--init-from", str(first), "--eval-only", "--eval-block-size", "5"])


def test_export_and_reload(tmp_path):
    from dflash2_tools.training.export import export

    folder, data = tiny_target_folder(tmp_path)
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    drafter.save_pretrained(tmp_path / "ckpt")
    out = export(tmp_path / "ckpt", tmp_path / "hub", target=str(folder))
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        names = list(f.keys())
        assert all(f.get_tensor(n).dtype == torch.bfloat16 for n in names)
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    from transformers import AutoModel

    reloaded = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32)
    ref_state = {k: v.to(torch.bfloat16).float() for k, v in drafter.state_dict().items()}
    got_state = reloaded.state_dict()
    assert ref_state.keys() == got_state.keys()
    assert all(torch.equal(ref_state[k], got_state[k]) for k in ref_state)  # exactly the bf16-rounded weights
    noise = torch.randn(1, 5, 48)
    feats = torch.randn(1, 6, 3 * 48)
    torch.testing.assert_close(
        reloaded(noise_embeds=noise, context_hidden_states=feats).last_hidden_state,
        drafter(noise_embeds=noise, context_hidden_states=feats).last_hidden_state,
        rtol=0.05,
        atol=0.05,
    )
    # the exported folder is a complete Hub-style repo: its custom_generate recipe runs DFlash 2
    ids = torch.tensor([[3, 4, 5, 6]])
    ref = target.generate(ids, do_sample=False, max_new_tokens=12)
    out_ids = target.generate(ids, custom_generate=str(out), trust_remote_code=True, assistant_model=reloaded, do_sample=False, max_new_tokens=12)
    assert torch.equal(ref, out_ids)


def test_length_bucketed_batches_cover_each_epoch_once_with_little_padding():
    lengths = np.random.default_rng(3).integers(20, 700, size=997)  # odd count: a ragged last window
    bs, world, per_epoch = 4, 2, 997 // 8
    for bucket in (0, 16):
        epoch = [[batches.batch_indices(lengths, bs, step, seed=5, rank=r, world=world, bucket=bucket) for r in range(world)]
                 for step in range(per_epoch)]
        flat = [i for step in epoch for rank in step for i in rank]
        assert len(flat) == len(set(flat)) == per_epoch * bs * world  # each sequence at most once per epoch
        assert all(len(rank) == bs for step in epoch for rank in step)
        assert epoch[0][0] == batches.batch_indices(lengths, bs, 0, seed=5, rank=0, world=world, bucket=bucket)  # deterministic
        assert batches.batch_indices(lengths, bs, per_epoch, seed=5, world=world, bucket=bucket) != epoch[0][0]  # next epoch reshuffles
        padded = sum(max(lengths[rank]) * bs for step in epoch for rank in step) / sum(lengths[flat])
        if bucket:
            assert padded < 1.1, padded
        else:
            assert padded > 1.3, padded


def test_split_sequences_cuts_responses_and_keeps_the_dev_split():
    seqs = [(np.arange(10 + i), 4) for i in range(120)]  # prompt 4 tokens, responses of 6..125
    train_all, dev_all = training_data.split_sequences(seqs, max_len=50)
    train_cut, dev_cut = training_data.split_sequences(seqs, max_len=50, max_response_tokens=8)
    assert len(train_cut) == len(train_all) and len(dev_cut) == len(dev_all) > 0
    assert max(len(t) for t, _ in train_all) == 50
    assert [len(t) for t, _ in train_cut][:3] == [10, 11, 12] and max(len(t) for t, _ in train_cut + dev_cut) == 12
    assert all(np.array_equal(a[: len(b)], b) for (a, _), (b, _) in zip(train_all, train_cut))
    short = [(np.arange(5), 4)]  # one response token: nothing to predict after the anchor
    assert training_data.split_sequences(short, max_len=50) == ([], [])


# ---- the recipe's levers: draft-vocabulary loss, feature store, distillation, chain weights, init ----------------


def test_draft_vocabulary_columns_and_loss_equal_the_restricted_full_loss():
    g = torch.Generator().manual_seed(0)
    vocab_ids = torch.randperm(VOCAB, generator=g)[:40].sort().values
    columns = losses.column_map(VOCAB, vocab_ids.tolist())
    labels = torch.stack([vocab_ids[3], vocab_ids[0], torch.tensor(-100), vocab_ids[39]])[None, None]  # [1, 1, 4]
    outside = int(next(i for i in range(VOCAB) if i not in set(vocab_ids.tolist())))
    cols = losses.label_columns(labels, columns)
    assert cols.tolist() == [[[3, 0, -100, 39]]]
    assert losses.label_columns(torch.tensor([outside]), columns).tolist() == [-100]  # undraftable: left out of the CE
    full = torch.randn(1, 1, 4, VOCAB, generator=g)
    w = torch.tensor([1.0, 0.7, 0.5, 0.3])
    torch.testing.assert_close(losses.block_cross_entropy(full[..., vocab_ids], cols, w),
                               (torch.stack([torch.nn.functional.cross_entropy(full[0, 0, k, vocab_ids], cols[0, 0, k]) for k in (0, 1, 3)])
                                * w[[0, 1, 3]]).sum() / w[[0, 1, 3]].sum())


def test_selector_loss_over_draft_columns_equals_the_full_vocabulary_loss():
    """A draft vocabulary that is a permutation of the whole vocabulary must give the same selector loss."""
    d = tiny_drafter(selector_top_k=4)
    g = torch.Generator().manual_seed(1)
    hidden, full = torch.randn(1, 2, 3, 48, generator=g), torch.randn(1, 2, 3, VOCAB, generator=g)
    labels = full.topk(2, -1).indices[..., 1]  # in the top-K everywhere
    perm = torch.randperm(VOCAB, generator=g)  # column j holds token perm[j]
    anchors = torch.tensor([[5, 6]])
    ref, _ = losses.selector_cross_entropy(d.candidate_selector, hidden, full, anchors, labels, torch.ones(3))
    got, _ = losses.selector_cross_entropy(d.candidate_selector, hidden, full[..., perm], anchors, labels, torch.ones(3), vocab_ids=perm)
    torch.testing.assert_close(got, ref)


def test_teacher_rows_and_distillation_loss():
    teacher = torch.arange(2 * 10 * 3, dtype=torch.float32).view(2, 10, 3)  # [b, T, k], row t holds 3t..3t+2
    rows = losses.teacher_at_blocks(teacher, torch.tensor([[2, 5], [0, 8]]), 4)  # [b, n, B-1, k]
    assert rows[0, 0, :, 0].tolist() == [6, 9, 12]  # block at anchor 2 predicts tokens 3..5 from positions 2..4
    assert rows[1, 1, :, 0].tolist() == [24 + 30, 27 + 30, 27 + 30]  # past the end: clamped (labels IGNORE there)
    logits = torch.randn(1, 1, 2, 7)
    logp = torch.log_softmax(torch.tensor([[[[2.0, 1.0], [0.0, 0.0]]]]), -1)  # [1, 1, 2, k=2]
    cols = torch.tensor([[[[4, 1], [0, 6]]]])
    got = losses.distillation_cross_entropy(logits, logp, cols, torch.tensor([[[True, False]]]), torch.ones(2))
    q = torch.log_softmax(logits[0, 0, 0], -1)
    p = logp[0, 0, 0].exp()
    torch.testing.assert_close(got, -(p[0] * q[4] + p[1] * q[1]))  # the invalid second position is left out
    # a drafter that matches the teacher on its top-k has the smallest loss among shifted ones
    match = torch.full((1, 1, 1, 7), -30.0)
    match[0, 0, 0, 4], match[0, 0, 0, 1] = 2.0, 1.0
    best = losses.distillation_cross_entropy(match, logp[:, :, :1], cols[:, :, :1], torch.ones(1, 1, 1, dtype=torch.bool), torch.ones(1))
    worse = losses.distillation_cross_entropy(match.roll(1, -1), logp[:, :, :1], cols[:, :, :1], torch.ones(1, 1, 1, dtype=torch.bool), torch.ones(1))
    assert best < worse


def test_chain_weights_track_the_chance_of_reaching_each_position():
    logits = torch.full((1, 1, 3, 5), -20.0)
    logits[0, 0, 0, 2] = 20.0  # position 1 surely right
    logits[0, 0, 1, :] = 0.0  # position 2 uniform: 1/5 right
    labels = torch.tensor([[[2, 3, 1]]])
    decay = torch.tensor([1.0, 0.5, 0.25])
    w = losses.chain_weights(logits, labels, decay, floor=0.1)
    torch.testing.assert_close(w, torch.tensor([[[1.0, 0.5 * 1.0, 0.25 * 0.2]]]), atol=1e-5, rtol=1e-4)
    wrong = losses.chain_weights(logits, torch.tensor([[[4, 3, 1]]]), decay, floor=0.1)  # position 1 wrong: floor after it
    torch.testing.assert_close(wrong, torch.tensor([[[1.0, 0.05, 0.025]]]), atol=1e-5, rtol=1e-4)
    assert not w.requires_grad


def test_teacher_is_the_targets_own_distribution_over_the_draft_columns():
    target = tiny_target("llama")
    drafter = tiny_drafter(target, draft_vocab_ids=list(range(0, VOCAB, 2)))
    head = forward.LossHead.of(drafter, target)
    tokens, lengths, _ = batches.collate([([3, 4, 5, 6, 7], 2), ([9, 8, 7], 1)], pad_id=0)
    feats, logp, cols = features.target_forward(target, tokens, lengths, drafter.config.target_layer_ids, None, head.module, 5, drafter.draft_logits)
    ref_feats, _, _ = features.target_forward(target, tokens, lengths, drafter.config.target_layer_ids)
    torch.testing.assert_close(feats, ref_feats)
    with torch.no_grad():
        full = target(tokens, attention_mask=(torch.arange(5)[None] < lengths[:, None]).long()).logits  # [b, T, V]
    ref_logp, ref_cols = torch.log_softmax(full[..., ::2], -1).topk(5, -1)
    torch.testing.assert_close(logp[0], ref_logp[0], atol=1e-4, rtol=1e-4)
    assert torch.equal(cols[0], ref_cols[0])


def test_feature_store_fills_lazily_persists_on_flush_and_is_read_back(tmp_path, monkeypatch):
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    cfg = drafter.config
    head = forward.LossHead.of(drafter, target)
    seqs = greedy_sequences(target, [[3, 4, 5], [9, 8, 7, 6], [1, 2]], max_new_tokens=10)
    width = len(cfg.target_layer_ids) * cfg.hidden_size
    store = features.FeatureStore(tmp_path / "s", [len(t) for t, _ in seqs], width, teacher_k=3)
    calls = []
    real = features.target_forward

    def counted(target, tokens, *a, **k):
        calls.append(tokens.shape[0])
        return real(target, tokens, *a, **k)

    monkeypatch.setattr(features, "target_forward", counted)
    args = (seqs, target, cfg, "cpu", contextlib.nullcontext, 0, head, 3)
    f1, (lp1, c1) = features.features_for_batch(store, [2, 0], *args)
    assert calls == [2] and store.missing([0, 1, 2]) == [1]
    online, lp_online, _ = real(target, *batches.collate([seqs[0]], 0)[:2], cfg.target_layer_ids, None, head.module, 3, drafter.draft_logits)
    torch.testing.assert_close(f1[1, : len(seqs[0][0])].float(), online[0].to(torch.bfloat16).float())
    torch.testing.assert_close(lp1[1, : len(seqs[0][0])], lp_online[0].half().float())
    features.features_for_batch(store, [0, 2], *args)
    assert calls == [2]  # both stored: no target forward
    # not flushed yet: a reopened store recomputes; flushed: it reads
    assert features.FeatureStore(tmp_path / "s", [len(t) for t, _ in seqs], width, 3).missing([0, 1, 2]) == [0, 1, 2]
    store.flush()
    reopened = features.FeatureStore(tmp_path / "s", [len(t) for t, _ in seqs], width, 3)
    assert reopened.missing([0, 1, 2]) == [1]
    f2, (lp2, c2) = features.features_for_batch(reopened, [2, 0], *args)
    assert calls == [2] and torch.equal(f1, f2) and torch.equal(lp1, lp2) and torch.equal(c1, c2)
    with pytest.raises(SystemExit, match="delete the folder"):
        features.FeatureStore(tmp_path / "s", [len(t) for t, _ in seqs[:2]], width, 3)
    key = features.store_key("t", [0, 2], None, False, 3, None, seqs)
    assert key != features.store_key("t", [0, 2], None, False, 0, None, seqs)
    assert key != features.store_key("t", [0, 2], None, False, 3, [1, 2], seqs)
    assert key != features.store_key("t", [0, 2], None, False, 3, None, seqs[:2])


def test_init_from_target_copies_its_last_layers_and_passes_the_deepest_tapped_layer():
    target = tiny_target("llama")  # 7 layers, hidden 48, 6 heads, MLP 72
    args = loop.parse_args(["--data", "x", "--out", "y", "--mask-token-id", "5", "--layers", "2", "--num-context-layers", "3",
                            "--selector-rank", "8", "--conv-group-size", "16"])
    args.target_name = "tiny"
    cfg = model.build_drafter_config(target, args)
    drafter = root.model_class()._from_config(cfg, dtype=torch.float32)
    copied = model.init_from_target(drafter, target)
    assert copied == [5, 6]
    for layer, i in zip(drafter.layers, copied):
        assert torch.equal(layer.self_attn.q_proj.weight, target.model.layers[i].self_attn.q_proj.weight)
        assert torch.equal(layer.mlp.down_proj.weight, target.model.layers[i].mlp.down_proj.weight)
    feats = torch.randn(1, 4, 3 * 48)
    torch.testing.assert_close(drafter.fuse_context(feats), drafter.hidden_norm(feats[..., -48:]))
    args = loop.parse_args(["--data", "x", "--out", "y", "--mask-token-id", "5", "--layers", "2", "--intermediate-size", "40"])
    args.target_name = "tiny"
    narrow = root.model_class()._from_config(model.build_drafter_config(target, args), dtype=torch.float32)
    with pytest.raises(ValueError, match="--init-from-target"):
        model.init_from_target(narrow, target)


def test_all_levers_train_end_to_end_under_a_cpu_budget(tmp_path):
    folder, data_dir = tiny_target_folder(tmp_path)
    common = ["--target", str(folder), "--data", str(data_dir), "--mask-token-id", str(VOCAB - 2), "--layers", "2",
              "--block-size", "4", "--batch-size", "2", "--blocks-per-seq", "4", "--eval-sequences", "2", "--eval-every", "1000",
              "--selector-rank", "8", "--selector-top-k", "4", "--conv-group-size", "16", "--precision", "fp32",
              "--feature-cache-dir", str(tmp_path / "features"), "--draft-vocab", "60", "--distill-weight", "1",
              "--teacher-k", "4", "--position-weighting", "chain", "--init-from-target", "--budget-cpu-minutes", "0.02",
              "--out", str(tmp_path / "run")]
    train.main(common)
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert log[-1]["train_cpu_seconds"] >= 0.02 * 60 and log[-1]["step"] >= 1 and "distill" in log[-1]
    ckpt = root.load_drafter(tmp_path / "run" / "checkpoint", dtype=torch.float32)
    assert len(ckpt.config.draft_vocab_ids) >= 60  # the draft vocabulary (+ EOS) it was trained and evaluated on
    (store,) = list((tmp_path / "features").glob("features-*"))
    assert (store / "teacher_logp.npy").exists() and np.load(store / "filled.npy").any()
    train.main(common)  # budget spent: the same command returns at once, nothing more is logged
    assert len((tmp_path / "run" / "log.jsonl").read_text().splitlines()) == len(log)


def test_a_new_store_copies_the_rows_other_stores_hold(tmp_path):
    """A new mix of known sequences (another order, one new, one dropped) takes every known sequence's rows from the
    store that holds them, with no target forward; a store of other settings, or a sequence not yet filled there,
    gives nothing."""
    rng = np.random.default_rng(0)
    seqs = [(np.arange(n) + 10 * n, 2) for n in (5, 7, 3, 6)]
    width, k = 4, 2
    settings = features.store_settings("t", [0, 2], None, False, k, None)
    old = features.FeatureStore(tmp_path / "features-old", [len(t) for t, _ in seqs], width, k, settings,
                                features.sequence_digests(seqs))
    rows = {}
    for i, (tokens, _) in enumerate(seqs[:3]):  # the 4th is never filled
        f, lp, cols = torch.from_numpy(rng.normal(size=(len(tokens), width))).float(), torch.rand(len(tokens), k), torch.randint(0, 9, (len(tokens), k))
        old.write(i, f, lp, cols)
        rows[i] = old.read(i)
    old.flush()
    other = features.store_settings("t", [0, 2], None, True, k, None)  # bf16 features: not the same rows
    features.FeatureStore(tmp_path / "features-bf16", [5], width, k, other, features.sequence_digests(seqs[:1]))
    mix = [seqs[2], (np.arange(9), 2), seqs[0], seqs[3]]  # reordered, a new sequence, one dropped
    new = features.FeatureStore(tmp_path / "features-new", [len(t) for t, _ in mix], width, k, settings,
                                features.sequence_digests(mix))
    assert new.seed_from_siblings() == 2
    assert new.missing(range(4)) == [1, 3]
    for i, j in ((0, 2), (2, 0)):
        for mine, theirs in zip(new.read(i), rows[j]):
            assert torch.equal(mine, theirs)
    reopened = features.FeatureStore(tmp_path / "features-new", [len(t) for t, _ in mix], width, k)
    assert reopened.missing(range(4)) == [1, 3]  # the copies were flushed
