"""Code and math training prompts: the domain classifier, and no evaluation problem (exact or near-duplicate) in the
training data -- checked on the committed data itself, with a method independent of the filter that built it."""

from __future__ import annotations

import ast
import re

import pytest
from conftest import root

from dflash2_tools import prompt_domains, prompt_school_math, prompt_stubs
from dflash2_tools.regenerate import load_chunks

CODE_MATH_DATA = root.REPO_ROOT / "data" / "smollm2-sharegpt-code-math-128"
STUB_DATA = root.REPO_ROOT / "data" / "smollm2-python-stubs-128"
MORE_STUB_DATA = root.REPO_ROOT / "data" / "smollm2-python-stubs-more-128"
SCHOOL_MATH_DATA = root.REPO_ROOT / "data" / "smollm2-school-math-128"


def test_domain_classifier():
    assert prompt_domains.domain("```python\nprint(1)\n```\nwhy does this fail?") == "code"
    assert prompt_domains.domain("Write a Python function that parses JSON from an API") == "code"
    assert prompt_domains.domain("Solve the equation 3x + 2 = 11 and explain each step") == "math"
    assert prompt_domains.domain("What is the probability of two heads, and the mean number of heads?") == "math"
    assert prompt_domains.domain("Write a poem about autumn leaves") is None


def test_guard_finds_an_evaluation_prompt_inside_a_longer_question():
    texts = prompt_domains.evaluation_texts()
    guard = prompt_domains.EvaluationGuard(texts)
    humaneval = next(t for k, t in texts.items() if k.startswith("HumanEval/"))
    champ = next(t for k, t in texts.items() if k.startswith("champ/"))
    assert guard.match("Can you help me with this?\n" + humaneval + "\nThanks!") is not None
    assert guard.match("Please solve: " + champ) is not None
    assert guard.match("Write a function that reverses a linked list in place, with tests.") is None


def char_grams(text: str, n: int = 40) -> set[str]:
    flat = re.sub(r"\s+", " ", text.lower()).strip()
    return {flat[i : i + n] for i in range(max(1, len(flat) - n + 1))}


STUB_SOURCE = '''
def _private(x):
    "A private helper that is long enough to qualify otherwise, and more."
    y = x
    return y

def short(x):
    "Too short."
    y = x
    return y

def wrapper(x):
    "Only forwards its argument to another function, nothing else at all."
    return g(x)

@cache
def scale(values: list[float], factor=2.0) -> list[float]:
    """Multiply every value by factor.

    >>> scale([1.0, 2.5])
    [2.0, 5.0]
    """
    secret_body = [v * factor for v in values]
    return secret_body
'''


def test_python_stub_keeps_signature_and_docstring_not_body():
    stubs = [s for node in ast.parse(STUB_SOURCE).body if (s := prompt_stubs.stub(node))]
    assert len(stubs) == 1, stubs
    text = stubs[0]
    assert text.startswith('def scale(values: list[float], factor=2.0) -> list[float]:\n    """Multiply every value')
    assert ">>> scale([1.0, 2.5])" in text and "secret_body" not in text and "@cache" not in text
    compile(text, "<stub>", "exec")  # the stub is valid Python (a function whose body is its docstring)


def test_the_second_stub_source_reads_other_libraries_and_names_their_versions():
    first = {name for name, _ in prompt_stubs.source_roots()}
    more = {name for name, _ in prompt_stubs.source_roots("python-stubs-more")}
    assert "stdlib" in first and {"torch", "transformers"} <= more and not first & more  # no function in both folders
    description = prompt_stubs.source_description("python-stubs-more")
    assert description.startswith("python-stubs-more:") and f"torch {torch_version()}" in description


def torch_version() -> str:
    import torch

    return torch.__version__


def assert_no_evaluation_prompt(prompts: list[str]) -> None:
    """No HumanEval or CHAMP prompt has 30% of its 40-character windows inside one of ``prompts``
    (a positive control shows the check finds one)."""
    assert len(prompts) >= 32
    train_grams = [char_grams(p) for p in prompts]
    index = {}
    for i, grams in enumerate(train_grams):
        for g in grams:
            index.setdefault(g, set()).add(i)
    texts = prompt_domains.evaluation_texts()

    def worst_overlap(text: str) -> float:
        grams = char_grams(text)
        hits = {}
        for g in grams:
            for i in index.get(g, ()):
                hits[i] = hits.get(i, 0) + 1
        return max(hits.values(), default=0) / len(grams)

    overlaps = {eid: worst_overlap(text) for eid, text in texts.items()}
    worst = max(overlaps, key=overlaps.get)
    assert overlaps[worst] < 0.3, (worst, overlaps[worst])
    # positive control: the same check flags an evaluation prompt pasted into a training prompt
    some = texts[worst]
    train_grams.append(char_grams("please help " + some))
    for g in train_grams[-1]:
        index.setdefault(g, set()).add(len(train_grams) - 1)
    assert worst_overlap(some) > 0.9


@pytest.mark.parametrize("folder", [CODE_MATH_DATA, STUB_DATA, MORE_STUB_DATA, SCHOOL_MATH_DATA],
                         ids=["sharegpt-code-math", "python-stubs", "python-stubs-more", "school-math"])
def test_committed_code_math_data_holds_no_evaluation_prompt(folder):
    """Every committed training prompt, decoded, against every HumanEval and CHAMP prompt."""
    if not list(folder.glob("chunk_*.npz")):
        pytest.skip(f"no chunk of {folder.name} is committed yet")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(root.REPO_ROOT)
    assert_no_evaluation_prompt([tokenizer.decode(tokens[:length]) for tokens, length in load_chunks(folder)])


def test_committed_school_math_list_holds_no_evaluation_prompt():
    """The whole committed question list (not only the answered part): distinct, math, no evaluation prompt."""
    records = prompt_school_math.school_math_prompts()
    questions = [r["messages"][-1]["content"] for r in records]
    assert len(records) > 1500 and len(set(questions)) == len(questions) == len({r["id"] for r in records})
    assert all(r["domain"] == "math" and r["messages"][-1]["role"] == "user" for r in records)
    assert_no_evaluation_prompt(questions)


def test_school_math_samples_the_generators_training_split():
    """The generator still runs under today's sympy/numpy (the shim), from its training modules only, every
    difficulty, questions within the generator's length cap; a module that raises is left out, not fatal."""
    pytest.importorskip("mathematics_dataset")
    pairs = prompt_school_math.school_math_questions(per_module_level=1)
    keys = {key for key, _ in pairs}
    modules = {key.split("/")[0] for key in keys}
    assert len(modules) >= 40 and {key.split("/")[1] for key in keys} == set(prompt_school_math.LEVELS)
    assert {"algebra__linear_1d", "numbers__gcd", "probability__swr_p_sequence"} <= modules
    assert all(0 < len(q) <= prompt_school_math.MAX_QUESTION_CHARS for _, q in pairs)
    # the committed list came from the same modules (a re-sample under other versions would show here)
    committed = {r["id"].split("/")[1] for r in prompt_school_math.school_math_prompts()}
    assert modules <= committed and len(committed - modules) <= 2  # the generator is not reproducible (see its module)
