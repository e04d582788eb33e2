"""End to end on the real embedded target (SmolLM2-135M-Instruct from PyPI), fp32, greedy."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from conftest import root

from dflash2_tools.target import load_target

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three tips for staying focused while studying.",
]


@pytest.fixture(scope="module")
def smollm2():
    torch.set_num_threads(2)
    target, tokenizer = load_target(dtype=torch.float32)
    if (root.REPO_ROOT / "model.safetensors").is_file():
        drafter = root.load_drafter(root.REPO_ROOT, dtype=torch.float32).eval()
    else:  # before a drafter is shipped: a random one of the shipped shape
        from dflash2_tools.training.loop import parse_args
        from dflash2_tools.training.model import build_drafter_config

        args = parse_args(["--data", "-", "--out", "-", "--mask-token-id", "16"])
        args.target_name = "HuggingFaceTB/SmolLM2-135M-Instruct"
        drafter = root.model_class()._from_config(build_drafter_config(target, args), dtype=torch.float32).eval()
    yield SimpleNamespace(target=target, tokenizer=tokenizer, drafter=drafter)
    torch.set_num_threads(1)


def _chat(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True)


def test_greedy_equals_target_on_chat_prompts(smollm2):
    for text in PROMPTS:
        inputs = _chat(smollm2.tokenizer, text)
        ref = smollm2.target.generate(**inputs, do_sample=False, max_new_tokens=40)
        out = smollm2.target.generate(**inputs, assistant_model=smollm2.drafter, do_sample=False, max_new_tokens=40)
        assert torch.equal(ref, out), smollm2.tokenizer.decode(out[0])


def test_custom_generate_local_folder(smollm2):
    inputs = _chat(smollm2.tokenizer, PROMPTS[0])
    ref = smollm2.target.generate(**inputs, do_sample=False, max_new_tokens=24)
    out = smollm2.target.generate(
        inputs["input_ids"],  # positional prompt: reaches the recipe as inputs=
        attention_mask=inputs["attention_mask"],
        custom_generate=str(root.REPO_ROOT),
        trust_remote_code=True,
        assistant_model=smollm2.drafter,
        do_sample=False,
        max_new_tokens=24,
    )
    assert torch.equal(ref, out)
    out2, stats = smollm2.target.generate(
        **inputs, custom_generate=str(root.REPO_ROOT), trust_remote_code=True, assistant_model=smollm2.drafter,
        do_sample=False, max_new_tokens=24, return_dflash2_stats=True,
    )
    assert torch.equal(ref, out2) and stats.new_tokens == out2.shape[1] - inputs["input_ids"].shape[1]
    assert len(stats.accept_lengths) > 0


def test_custom_generate_needs_the_drafter(smollm2):
    inputs = _chat(smollm2.tokenizer, PROMPTS[0])
    with pytest.raises(ValueError, match="needs the drafter"):
        smollm2.target.generate(**inputs, custom_generate=str(root.REPO_ROOT), trust_remote_code=True, max_new_tokens=4)


def test_text_iterator_streamer_same_text(smollm2):
    from transformers import TextIteratorStreamer

    inputs = _chat(smollm2.tokenizer, PROMPTS[2])

    def stream(**kw):
        streamer = TextIteratorStreamer(smollm2.tokenizer, skip_prompt=True)
        thread = threading.Thread(target=smollm2.target.generate, kwargs=dict(**inputs, do_sample=False, max_new_tokens=32, streamer=streamer, **kw))
        thread.start()
        text = "".join(streamer)
        thread.join()
        return text

    assert stream() == stream(assistant_model=smollm2.drafter)


def test_batch_of_four_equals_the_targets_batched_generate(smollm2):
    """Four chat prompts of different lengths, left-padded: every row equals the target's own batched generate."""
    texts = PROMPTS + ["Explain in two sentences why the sky looks blue during the day but red at sunset."]
    tokenizer = smollm2.tokenizer
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False) for t in texts]
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        inputs = tokenizer(chats, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = side
    assert len(set(inputs["attention_mask"].sum(-1).tolist())) == 4  # four different prompt lengths
    kw = dict(do_sample=False, max_new_tokens=48)
    ref = smollm2.target.generate(**inputs, **kw)
    with root.generation().collect_stats() as runs:
        out = smollm2.target.generate(**inputs, assistant_model=smollm2.drafter, **kw)
    assert torch.equal(ref, out), [tokenizer.decode(row) for row in out]
    assert runs[-1].batch_size == 4 and runs[-1].forwards > 0
