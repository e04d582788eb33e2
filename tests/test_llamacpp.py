"""llama.cpp interop: the log parser always; the agreement with our plain call only where llama.cpp is built
(``python -m dflash2_tools.llamacpp build``, ~5-15 min of both cores; CI runs it where a build is cached)."""

from __future__ import annotations

import pytest

from dflash2_tools import llamacpp

LOG = """
encoded   52 tokens in    0.210 seconds, speed:  247.619 t/s
decoded  128 tokens in    1.532 seconds, speed:   83.551 t/s

n_draft   = 16
n_predict = 128
n_drafted = 336
n_accept  = 80
accept    = 23.810%
"""


def test_speculative_log_parser():
    got = llamacpp.parse_speculative_log(LOG)
    assert got["new_tokens"] == 128 and got["accepted"] == 80 and got["drafted"] == 336
    assert got["acceptance_length"] == pytest.approx(128 / 48)  # 48 target forwards committed 128 tokens
    assert got["tok_per_s"] == pytest.approx(83.551)
    with pytest.raises(RuntimeError, match="n_predict"):
        llamacpp.parse_speculative_log("decoded nothing")


def test_first_divergence_is_counted_in_our_tokens():
    class CharTokenizer:  # one token per character
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": list(text)}

    assert llamacpp.first_divergence_token(CharTokenizer(), "abcdef", "abcXef") == 3
    assert llamacpp.first_divergence_token(CharTokenizer(), "abc", "abcdef") is None  # ours is a prefix: no difference seen


AGREEMENT = 0.25  # tokens per forward; same-text gaps measured on 8 ShareGPT-dev prompts: mean 0.07, max 0.20 (docs/llamacpp)
BIN = llamacpp.llamacpp_dir() / "build" / "bin"
PROMPT_ID = "sharegpt/6TbIqut_0"  # held-out dev, 196 prompt tokens, code: the drafter accepts ~3.5 tokens per forward there


@pytest.mark.skipif(not all((BIN / b).is_file() for b in llamacpp.BINARIES),
                    reason="llama.cpp is not built here: python -m dflash2_tools.llamacpp build")
def test_llamacpp_and_our_drafter_agree_on_the_same_text(tmp_path):
    """The shipped weights in llama.cpp's DFlash 2 (its own converter, Q4_1 target) and in our code,
    on llama.cpp's greedy text: the same tokens per target forward up to the targets' numerics."""
    pytest.importorskip("sentencepiece", reason="llama.cpp's converter needs sentencepiece")
    import torch
    from conftest import root

    from dflash2_tools.prompts import load_prompt_set
    from dflash2_tools.target import load_target

    torch.set_num_threads(2)
    target, tokenizer = load_target(dtype=torch.float32)
    drafter = root.load_drafter(root.REPO_ROOT, dtype=torch.float32).eval()
    gguf = llamacpp.convert(root.REPO_ROOT, out=tmp_path / "drafter.gguf")
    record = next(r for r in load_prompt_set("sharegpt-dev") if r["id"] == PROMPT_ID)
    text = tokenizer.apply_chat_template(record["messages"], add_generation_prompt=True, tokenize=False)
    theirs = llamacpp.run_llamacpp(BIN, text, gguf, "draft-dflash", 96, threads=2, n_draft=drafter.config.block_size - 1)
    ours = llamacpp.replay_acceptance(drafter, target, tokenizer, text, theirs["text"], 96)
    assert theirs["acceptance_length"] > 2.5  # the drafter drafts well there, so a broken side would show
    assert ours == pytest.approx(theirs["acceptance_length"], abs=AGREEMENT)
    # negative control: the tapped layers fused in the wrong order (a converter-style bug) disagree
    ids = list(drafter.config.target_layer_ids)
    drafter.config.target_layer_ids = ids[::-1]
    try:
        reversed_taps = llamacpp.replay_acceptance(drafter, target, tokenizer, text, theirs["text"], 96)
    finally:
        drafter.config.target_layer_ids = ids
    assert abs(reversed_taps - theirs["acceptance_length"]) > AGREEMENT
