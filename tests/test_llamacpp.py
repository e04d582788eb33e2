"""llama.cpp interop: the log parser always; the agreement with our plain call only where llama.cpp is built
(``python -m dflash2_tools.llamacpp build``; CI does not build it: ~15 min of both cores)."""

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
