"""Training pipeline: loss pieces on tiny data, optimisation, export, exact resume."""

from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import VOCAB, greedy_sequences, root, tiny_drafter, tiny_target

from dflash2_tools import losses, train
from dflash2_tools.regenerate import load_chunks, save_chunk


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
    m = modeling_module.multi_block_training_mask(torch.tensor([[2, 5]]), 3, 7)[0, 0]  # [6, 7 + 6]
    for q in range(6):
        block, anchor = divmod(q, 3)[0], (2, 5)[q // 3]
        assert m[q, :7].tolist() == [p < anchor for p in range(7)]
        assert m[q, 7:].tolist() == [k // 3 == block for k in range(6)]
    windowed = modeling_module.multi_block_training_mask(torch.tensor([[5]]), 3, 7, sliding_window=2)[0, 0]
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
    args = SimpleNamespace(blocks_per_seq=8, gamma=None, selector_weight=1.0)
    batch = train.collate(seqs, pad_id=0)
    feats = train.target_features(target, batch[0], batch[1], drafter.config.target_layer_ids)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)

    def loss_at(seed):
        return train.compute_loss(drafter, target, batch, feats, torch.Generator().manual_seed(seed), args)[0]

    with torch.no_grad():
        before = loss_at(0).item()
    for step in range(15):
        loss_at(step + 1).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        assert loss_at(0).item() < 0.7 * before


def test_feature_cache_on_disk_reloads_without_the_target(tmp_path, monkeypatch):
    target = tiny_target("llama")
    seqs = greedy_sequences(target, [[3, 4, 5], [9, 8, 7, 6], [1, 2]], max_new_tokens=10)
    layers = [0, 2]
    cache_args = (target, seqs, layers, None, 2, "cpu", contextlib.nullcontext, 0)
    path = tmp_path / "features.npy"
    first = train.cache_features(*cache_args, path=path)
    assert path.exists() and not list(tmp_path.glob("*.partial.npy"))
    tokens, lengths, _ = train.collate(seqs[1:2], pad_id=0)
    online = train.target_features(target, tokens, lengths, layers)[0]  # [T, 2H]
    torch.testing.assert_close(first[1].float(), online.to(torch.bfloat16).float())

    def no_target(*args, **kwargs):
        raise AssertionError("the cached file must be read, not recomputed")

    monkeypatch.setattr(train, "target_features", no_target)
    again = train.cache_features(*cache_args, path=path)
    for a, b, (t, _) in zip(first, again, seqs):
        assert a.dtype == b.dtype == torch.bfloat16 and b.shape == (len(t), 2 * target.config.hidden_size)
        assert torch.equal(a, b)
    key = train.feature_cache_key("t", layers, None, False, seqs)
    changed = [(seqs[0][0][:-1] + [seqs[0][0][-1] + 1], seqs[0][1])] + seqs[1:]
    assert key != train.feature_cache_key("t", layers, None, False, changed)
    assert key != train.feature_cache_key("t", [0, 1], None, False, seqs)
    with pytest.raises(SystemExit, match="delete it"):
        train.cache_features(*cache_args[:1], seqs[:2], *cache_args[2:], path=path)


def _tiny_target_folder(tmp_path):
    """A tiny target saved with a word-level tokenizer, usable as --target by the CLI."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    target = tiny_target("llama")
    folder = tmp_path / "target"
    target.save_pretrained(folder)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0")), pad_token="t0")
    tok.save_pretrained(folder)
    data = tmp_path / "data"
    data.mkdir()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB - 2, (int(n),), generator=g).tolist() for n in torch.randint(2, 9, (12,), generator=g)]
    seqs = greedy_sequences(target, prompts, max_new_tokens=24)
    save_chunk(data / "chunk_00000.npz", [s[:p] for s, p in seqs], [s[p:] for s, p in seqs])
    return folder, data


def test_stop_and_resume_equals_uninterrupted(tmp_path):
    folder, data = _tiny_target_folder(tmp_path)
    assert len(load_chunks(data)) == 12
    common = ["--target", str(folder), "--data", str(data), "--mask-token-id", str(VOCAB - 2), "--layers", "2",
              "--block-size", "4", "--batch-size", "2", "--blocks-per-seq", "4", "--max-steps", "6", "--eval-every", "3",
              "--eval-sequences", "2", "--selector-rank", "8", "--selector-top-k", "4", "--heads", "6", "--kv-heads", "2",
              "--conv-group-size", "16"]
    train.main(common + ["--out", str(tmp_path / "a")])
    # run b keeps its feature cache on disk: the first half writes it, the resumed half memory-maps it
    on_disk = ["--feature-cache-dir", str(tmp_path / "features")]
    train.main(common + on_disk + ["--out", str(tmp_path / "b"), "--stop-after", "4", "--save-every", "2"])
    state = torch.load(tmp_path / "b" / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 4
    assert len(list((tmp_path / "features").glob("features-*.npy"))) == 1
    train.main(common + on_disk + ["--out", str(tmp_path / "b"), "--save-every", "2"])  # same command resumes
    a = root.load_drafter(tmp_path / "a" / "checkpoint", dtype=torch.float32).state_dict()
    b = root.load_drafter(tmp_path / "b" / "checkpoint", dtype=torch.float32).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    log = [json.loads(line) for line in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [3, 6] and "acceptance_length_argmax" in log[-1]["dev"]


def test_warm_start_logs_its_baseline_and_eval_only_reproduces_it(tmp_path, capsys):
    folder, data = _tiny_target_folder(tmp_path)
    common = ["--target", str(folder), "--data", str(data), "--mask-token-id", str(VOCAB - 2), "--layers", "2",
              "--block-size", "4", "--batch-size", "2", "--blocks-per-seq", "4", "--eval-sequences", "2",
              "--selector-rank", "8", "--selector-top-k", "4", "--heads", "6", "--kv-heads", "2", "--conv-group-size", "16"]
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
    n_train = sum(1 for i, (t, p) in enumerate(seqs) if len(t) - p >= 2 and not train.is_dev_sequence(i))
    assert f"data: {n_train} train / " in out  # both folders were read


def test_export_and_reload(tmp_path):
    from dflash2_tools.export import export

    folder, data = _tiny_target_folder(tmp_path)
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
        epoch = [[train.batch_indices(lengths, bs, step, seed=5, rank=r, world=world, bucket=bucket) for r in range(world)]
                 for step in range(per_epoch)]
        flat = [i for step in epoch for rank in step for i in rank]
        assert len(flat) == len(set(flat)) == per_epoch * bs * world  # each sequence at most once per epoch
        assert all(len(rank) == bs for step in epoch for rank in step)
        assert epoch[0][0] == train.batch_indices(lengths, bs, 0, seed=5, rank=0, world=world, bucket=bucket)  # deterministic
        assert train.batch_indices(lengths, bs, per_epoch, seed=5, world=world, bucket=bucket) != epoch[0][0]  # next epoch reshuffles
        padded = sum(max(lengths[rank]) * bs for step in epoch for rank in step) / sum(lengths[flat])
        if bucket:
            assert padded < 1.1, padded
        else:
            assert padded > 1.3, padded


def test_split_sequences_cuts_responses_and_keeps_the_dev_split():
    seqs = [(np.arange(10 + i), 4) for i in range(120)]  # prompt 4 tokens, responses of 6..125
    train_all, dev_all = train.split_sequences(seqs, max_len=50)
    train_cut, dev_cut = train.split_sequences(seqs, max_len=50, max_response_tokens=8)
    assert len(train_cut) == len(train_all) and len(dev_cut) == len(dev_all) > 0
    assert max(len(t) for t, _ in train_all) == 50
    assert [len(t) for t, _ in train_cut][:3] == [10, 11, 12] and max(len(t) for t, _ in train_cut + dev_cut) == 12
    assert all(np.array_equal(a[: len(b)], b) for (a, _), (b, _) in zip(train_all, train_cut))
    short = [(np.arange(5), 4)]  # one response token: nothing to predict after the anchor
    assert train.split_sequences(short, max_len=50) == ([], [])
