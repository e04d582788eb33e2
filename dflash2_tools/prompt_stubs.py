"""Function-stub code prompts from the source of installed Python libraries (training side only).

HumanEval asks the target to complete a function from its signature and docstring; the
ShareGPT code turns ask questions in prose. The drafter accepts least on HumanEval, so this
source gives the data engine prompts in HumanEval's own form, written by someone else: every
public module-level function of the standard library and of a few installed libraries (sympy,
networkx, mpmath, numpy; ``python-stubs-more``: torch, transformers and the other installed ones)
that has a docstring of a useful size and a body of its own, cut down to its signature and docstring::

    Complete the following Python function.

    def gcd_list(seq):
        \"\"\"Compute the GCD of a list of numbers. ...\"\"\"

The function's body (the answer) is never in the prompt; the target writes its own, which is
what the drafter must learn to predict. These are library functions, not evaluation problems:
HumanEval and CHAMP near-duplicates are still dropped by ``prompt_domains.EvaluationGuard``
(none were found when this was written), and nothing from MBPP or GSM8K is read.

The prompts depend on the installed versions, so ``source_description`` names them and the data
engine's ``meta.json`` refuses to resume a folder under other versions.
"""

from __future__ import annotations

import ast
import copy
import importlib.metadata
import importlib.util
import sys
import sysconfig
import textwrap
from pathlib import Path

from .prompt_domains import EvaluationGuard, evaluation_texts

# the libraries each prompt source reads ("stdlib": the standard library). The second source takes the other
# libraries the project installs, none of the first's, so the two data folders hold different functions (3,300 more
# stubs, torch and transformers the most); not pip / setuptools: each new environment has other versions of them
SOURCES = {
    "python-stubs": ("stdlib", "sympy", "networkx", "mpmath", "numpy"),
    "python-stubs-more": ("torch", "transformers", "accelerate", "huggingface_hub", "safetensors", "PIL", "jinja2", "click",
                          "rich", "requests", "yaml", "tqdm", "packaging", "fsspec", "markdown_it", "pygments", "urllib3",
                          "charset_normalizer", "psutil", "regex"),
}
SKIP_PARTS = {"test", "tests", "testing", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "site-packages"}
DOCSTRING_CHARS = (60, 800)  # shorter says too little to complete from; longer does not fit the prompt budget
MIN_BODY_STATEMENTS = 3  # the docstring plus at least two statements: a real implementation, not a wrapper
INSTRUCTION = "Complete the following Python function.\n\n"  # HumanEval's prompt form (prompts.humaneval_prompts)


def source_roots(source: str = "python-stubs") -> list[tuple[str, Path]]:
    """(name, folder) of every library the prompt source scans, in ``SOURCES`` order (those not installed skipped)."""
    roots = []
    for name in SOURCES[source]:
        if name == "stdlib":
            roots.append((name, Path(sysconfig.get_paths()["stdlib"])))
            continue
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            roots.append((name, Path(spec.origin).parent))
    return roots


def source_description(source: str = "python-stubs") -> str:
    """What meta.json records: the sources and their versions (the prompts change with them)."""
    versions = [f"python {sys.version_info.major}.{sys.version_info.minor}"]
    distributions = importlib.metadata.packages_distributions()  # import name -> distributions (PIL -> pillow)
    for name, _ in source_roots(source):
        if name != "stdlib":
            versions.append(f"{name} {importlib.metadata.version(distributions.get(name, [name])[0])}")
    return f"{source}: signatures + docstrings of public library functions (prompt_stubs.py), " + ", ".join(versions)


def stub(node: ast.FunctionDef) -> str | None:
    """``def name(signature):`` + the docstring, re-indented, or None when the function does not qualify."""
    doc = ast.get_docstring(node)
    if node.name.startswith("_") or doc is None or len(node.body) < MIN_BODY_STATEMENTS:
        return None
    if not DOCSTRING_CHARS[0] <= len(doc) <= DOCSTRING_CHARS[1] or '"""' in doc:
        return None
    head = copy.copy(node)  # shallow: only the body and decorators are replaced
    head.body, head.decorator_list = [ast.Pass()], []
    signature = ast.unparse(head).splitlines()[0]  # "def name(args) -> ret:"
    return f'{signature}\n    """{textwrap.indent(doc, "    ").lstrip()}\n    """\n'


def module_stubs(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):  # a few stdlib files are templates or other encodings
        return []
    return [s for node in tree.body if isinstance(node, ast.FunctionDef) and (s := stub(node))]


def python_stub_prompts(guard: EvaluationGuard | None = None, source: str = "python-stubs") -> list[dict]:
    """One chat record per qualifying function, in a fixed order (sources, files sorted, then file order);
    duplicates of the same stub text and evaluation near-duplicates dropped."""
    guard = guard or EvaluationGuard(evaluation_texts())
    seen, out = set(), []
    for name, root in source_roots(source):
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root)
            if SKIP_PARTS & set(rel.parts[:-1]):
                continue
            for text in module_stubs(path):
                if text in seen or guard.match(text):
                    continue
                seen.add(text)
                out.append({"id": f"stub/{name}/{rel.as_posix()}/{len(out)}", "domain": "code",
                            "messages": [{"role": "user", "content": INSTRUCTION + text}]})
    return out
