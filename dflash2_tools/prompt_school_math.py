"""Math questions from DeepMind's ``mathematics_dataset`` generator, training split only (training side only).

The ShareGPT turns hold few math questions (875 of 4,946 code/math turns), and CHAMP's acceptance
has barely moved with them. ``mathematics_dataset`` (PyPI, Saxton et al. 2019) ships the
generator behind DeepMind's school-mathematics corpus: 56 modules (algebra, arithmetic, number
theory, polynomials, probability, comparison, measurement, ...), each with a *training* split
whose questions its authors keep apart from their interpolation / extrapolation test sets.
This source samples that training split only, at the generator's three training difficulties::

    Solve -16*p + 517 = -72*p + 69 for p.
    Three letters picked without replacement from {l: 3, f: 1, j: 5, t: 3}. Give prob of picking 3 t.

What the drafter learns is the target's answer to such a question (its math register: "To
solve ..., we ..."); the question is the generator's, never an evaluation set's. HumanEval and
CHAMP near-duplicates are still dropped by ``prompt_domains.EvaluationGuard``; nothing is read
from MBPP or GSM8K.

The package was written for 2019's sympy and numpy. Two facts of today's versions matter here:
sympy moved ``base_solution_linear`` into ``sympy.solvers.diophantine.diophantine`` (aliased back
before the import, or nothing imports), and numpy 2 dropped ``ndarray.itemset`` / ``np.object``,
which some modules call: a module whose sample raises is left out.

The generator is not reproducible across processes, even under fixed seeds: it draws variable
names and the order of its "Let ... Suppose ..." clauses from sets whose order follows hashes and
memory addresses (measured: 886 of 2,182 questions differed between two runs with the same seeds,
1,276 with a fixed PYTHONHASHSEED). A data folder answers its prompts in chunks over several
sessions, so the list is sampled once and committed (``LIST``, one chat record per line); the
data engine reads that file, and ``meta.json`` names its digest. Re-sample with
``python -m dflash2_tools.prompt_school_math --out <file>`` (a new list, for a new data folder).
"""

from __future__ import annotations

import hashlib
import importlib
import argparse
import importlib.metadata
import json
import random
import warnings
from pathlib import Path

import numpy as np

from .prompt_domains import EvaluationGuard, evaluation_texts

PACKAGE, PIP_NAME = "mathematics_dataset", "mathematics_dataset==1.0.1"
LIST = Path(__file__).parent / "prompt_lists" / "school_math.jsonl"  # the committed sample the data engine answers
LEVELS = ("easy", "medium", "hard")  # the generator's three training difficulties (thirds of each module's entropy range)
PER_MODULE_LEVEL = 16  # questions per (module, difficulty): ~46 working modules x 3 x 16 = ~2,200 prompts
MAX_QUESTION_CHARS = 160  # the generator's own cap on a question's length (generate_settings.MAX_QUESTION_LENGTH)


def _load_modules():
    """The package's ``modules`` module, importable under today's sympy (see the module docstring)."""
    try:
        diophantine = importlib.import_module("sympy.solvers.diophantine")
        inner = importlib.import_module("sympy.solvers.diophantine.diophantine")
        if not hasattr(diophantine, "base_solution_linear"):
            diophantine.base_solution_linear = inner.base_solution_linear  # moved in sympy 1.7
        return importlib.import_module(f"{PACKAGE}.modules.modules")
    except ImportError as e:
        raise SystemExit(f"the school-math prompts need {PIP_NAME} and its small dependencies: "
                         f"pip install --no-deps -r requirements-data.txt ({e})") from e


def _entropy_fn(level: int, levels: int = len(LEVELS)):
    """Restrict a module's entropy range [a, b] to its ``level``-th third, as the generator's train-easy/medium/hard do."""
    def restrict(range_):
        a, b = range_
        return a + (b - a) * level / levels, a + (b - a) * (level + 1) / levels
    return restrict


def _flatten(tree: dict, prefix: str = "") -> dict:
    """{'algebra': {'linear_1d': f}} -> {'algebra__linear_1d': f}, sorted by name (a fixed order)."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}__{key}" if prefix else key
        flat.update(_flatten(value, name) if isinstance(value, dict) else {name: value})
    return dict(sorted(flat.items()))


def _seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:4], "little")


def _sample(generate, seed: int) -> str | None:
    """One question of a module under a fixed seed; None if the module raises (numpy 2, see above) or runs long."""
    random.seed(seed)
    np.random.seed(seed)
    try:
        with warnings.catch_warnings():  # numpy 2's FutureWarning on np.object, once per failing call
            warnings.simplefilter("ignore", FutureWarning)
            question = str(generate().question)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return None
    return question if len(question) <= MAX_QUESTION_CHARS else None


def school_math_questions(per_module_level: int = PER_MODULE_LEVEL) -> list[tuple[str, str]]:
    """(module name with difficulty, question) in round-robin order: question i of every (module, difficulty)
    before question i + 1 of any, so any prefix of the list covers every module alike."""
    modules = _load_modules()
    generators = {}
    for level, name in enumerate(LEVELS):
        for module, generate in _flatten(modules.train(_entropy_fn(level))).items():
            generators[f"{module}/{name}"] = generate
    working = {k: g for k, g in generators.items() if _sample(g, _seed(k, "probe")) is not None}
    out = []
    for i in range(per_module_level):
        for key, generate in working.items():
            question = _sample(generate, _seed(key, i))
            if question is not None:
                out.append((key, question))
    return out


def sample_prompts(per_module_level: int = PER_MODULE_LEVEL, guard: EvaluationGuard | None = None) -> list[dict]:
    """A fresh sample: one chat record per question; repeats of the same text and evaluation near-duplicates dropped."""
    guard = guard or EvaluationGuard(evaluation_texts())
    seen, out = set(), []
    for key, question in school_math_questions(per_module_level):
        if question in seen or guard.match(question):
            continue
        seen.add(question)
        out.append({"id": f"school-math/{key}/{len(out)}", "domain": "math",
                    "messages": [{"role": "user", "content": question}]})
    return out


def school_math_prompts(path: Path = LIST) -> list[dict]:
    """The committed sample (see the module docstring for why it is a file)."""
    if not path.is_file():
        raise SystemExit(f"{path} is missing: sample one with python -m dflash2_tools.prompt_school_math --out {path}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def list_digest(path: Path = LIST) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def source_description() -> str:
    """What meta.json records: the committed list, by digest (a re-sampled list is another source)."""
    return (f"school-math: mathematics_dataset training split, difficulties {'/'.join(LEVELS)} (prompt_school_math.py), "
            f"list {LIST.name} sha256 {list_digest()}")


def main(argv=None):
    ap = argparse.ArgumentParser(description="Sample school-math training questions into a JSONL prompt list.")
    ap.add_argument("--out", type=Path, default=LIST)
    ap.add_argument("--per-module-level", type=int, default=PER_MODULE_LEVEL)
    args = ap.parse_args(argv)
    records = sample_prompts(args.per_module_level)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"{len(records)} prompts from {len({r['id'].split('/')[1] for r in records})} modules -> {args.out}")


if __name__ == "__main__":
    main()
