"""Code and math training prompts, and the guard that keeps evaluation problems out of them.

The drafter's earlier data answered chat prompts only; it accepts far less on code (HumanEval)
and math (CHAMP) than on chat. The target's answers to code and math questions are formulaic,
so a drafter that has seen them drafts more of them. The prompts come from the training split
of ShareGPT (every human turn with its history, ``prompts.sharegpt_turn_prompts``), classified
by the last question's text:

* code: a fenced block, a traceback, or at least two programming cues (language names, ``def``,
  ``import``, ``SELECT``, "function", "compile", ...);
* math: at least two mathematical cues (equation, integral, probability, "solve", an arithmetic
  expression such as ``3x + 2 = 11``, LaTeX, ...).

Evaluation problems never enter: every candidate is compared with every HumanEval and CHAMP
prompt by word 8-gram shingles, and one that shares 30% of an evaluation prompt's shingles (or
contains it whole) is dropped. MBPP and GSM8K are not shipped by any package installed here,
so they cannot be compared; no source of them is used either.
"""

from __future__ import annotations

import re
from collections import defaultdict

from .prompts import champ_prompts, humaneval_prompts, sharegpt_turn_prompts

CODE_CUES = re.compile(
    r"\b(python|javascript|typescript|java|c\+\+|c#|golang|rust|kotlin|swift|php|ruby|sql|html|css|"
    r"bash|shell script|powershell|regex|json|yaml|api|function|method|class|compile[rd]?|debug|"
    r"script|code|program(?:ming)?|algorithm|array|dataframe|pandas|numpy|react|node\.?js|django|flask|"
    r"def|import|return|select|lambda|async|const|var|println|printf|stack ?trace|exception)\b",
    re.IGNORECASE,
)
CODE_STRONG = re.compile(r"```|Traceback \(most recent call last\)|^\s*(def|class|import|#include|SELECT) ", re.MULTILINE)
MATH_CUES = re.compile(
    r"\b(math|equation|integral|derivative|probability|calculate|compute|solve|prove|proof|theorem|"
    r"matrix|matrices|vector|polynomial|algebra|geometry|triangle|circle|area|perimeter|percent(?:age)?|"
    r"fraction|ratio|sum|product|prime|factor(?:ial)?|logarithm|sqrt|square root|exponent|limit|"
    r"mean|median|variance|interest rate|how many|how much)\b",
    re.IGNORECASE,
)
MATH_STRONG = re.compile(r"\d\s*[a-z]?\s*[-+*/^×÷=]\s*\d|\\frac|\\int|\\sum|\$[^$]+\$|[a-z]\^\d")

SHINGLE = 8  # words per shingle
NEAR_DUPLICATE = 0.3  # share of an evaluation prompt's shingles that makes a candidate a near duplicate


def domain(text: str) -> str | None:
    """'code', 'math' or None (chat) for a question's text."""
    if CODE_STRONG.search(text) or len(set(m.lower() for m in CODE_CUES.findall(text))) >= 2:
        return "code"
    math_cues = len(set(m.lower() for m in MATH_CUES.findall(text)))
    if math_cues >= 2 or (math_cues >= 1 and MATH_STRONG.search(text)):
        return "math"
    return None


def shingles(text: str) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + SHINGLE]) for i in range(max(1, len(words) - SHINGLE + 1))}


class EvaluationGuard:
    """Finds candidates that contain (nearly) an evaluation prompt."""

    def __init__(self, eval_texts: dict[str, str]):
        self.sizes = {}
        self.index = defaultdict(set)  # shingle -> evaluation ids that hold it
        for eid, text in eval_texts.items():
            s = shingles(text)
            self.sizes[eid] = len(s)
            for sh in s:
                self.index[sh].add(eid)

    def match(self, text: str) -> str | None:
        """The id of an evaluation prompt this text nearly contains, else None."""
        hits = defaultdict(int)
        for sh in shingles(text):
            for eid in self.index.get(sh, ()):
                hits[eid] += 1
        for eid, n in hits.items():
            if n >= NEAR_DUPLICATE * self.sizes[eid]:
                return eid
        return None


def evaluation_texts() -> dict[str, str]:
    """Every evaluation prompt this project measures on (the user message's text), by id."""
    records = humaneval_prompts() + champ_prompts()
    return {r["id"]: r["messages"][-1]["content"] for r in records}


def sharegpt_code_math_prompts(split: str = "train", guard: EvaluationGuard | None = None) -> list[dict]:
    """ShareGPT turns whose question asks for code or math, evaluation near-duplicates dropped.
    Records carry ``domain``; code first, then math, each in the turn order of ``sharegpt_turn_prompts``."""
    guard = guard or EvaluationGuard(evaluation_texts())
    by_domain = {"code": [], "math": []}
    for record in sharegpt_turn_prompts(split):
        question = record["messages"][-1]["content"]
        d = domain(question)
        if d is None or any(guard.match(m["content"]) for m in record["messages"] if m["role"] == "user"):
            continue
        by_domain[d].append({**record, "domain": d})
    return by_domain["code"] + by_domain["math"]
