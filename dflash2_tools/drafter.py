"""Load the root remote-code modules the way a user does (``trust_remote_code``), never by plain import.

The repository root IS the Hub repo; its modules use relative imports, so they are loaded
through transformers' dynamic-module machinery exactly as ``AutoModel.from_pretrained(REPO,
trust_remote_code=True)`` would.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# the root modules a drafter folder needs (what save_pretrained copies next to the weights)
REMOTE_CODE_FILES = ("configuration_dflash2.py", "modeling_dflash2.py", "layers_dflash2.py", "generation_dflash2.py", "accept_dflash2.py",
                     "attention_dflash2.py", "checks_dflash2.py", "costs_dflash2.py", "holes_dflash2.py",
                     "devices_dflash2.py", "loop_dflash2.py", "ngram_dflash2.py", "proposer_dflash2.py", "rollback_dflash2.py",
                     "selector_dflash2.py", "stats_dflash2.py", "suffix_dflash2.py", "tree_dflash2.py")


@functools.lru_cache(maxsize=None)
def modeling(repo: str | Path = REPO_ROOT):
    """The root ``modeling_dflash2`` module, imported as remote code (once per folder and process: the
    training loop asks every step, and a long run must not pick up files edited under it)."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    cls = get_class_from_dynamic_module("modeling_dflash2.DFlash2DraftModel", str(repo))
    return sys.modules[cls.__module__]


def _package_module(module_name: str, name: str):
    """Module ``name`` of the dynamic package that holds ``module_name``."""
    return sys.modules[module_name.rsplit(".", 1)[0] + "." + name]


def _sibling(name: str, repo: str | Path = REPO_ROOT):
    """A root module imported by ``modeling_dflash2`` (same dynamic package)."""
    return _package_module(modeling(repo).__name__, name)


def generation(repo: str | Path = REPO_ROOT):
    return _sibling("generation_dflash2", repo)


def tree(repo: str | Path = REPO_ROOT):
    """The root ``tree_dflash2`` module (tree verification)."""
    return _sibling("tree_dflash2", repo)


def selector(repo: str | Path = REPO_ROOT):
    """The root ``selector_dflash2`` module (the candidate selector's walk and lattice, the draft-vocabulary head)."""
    return _sibling("selector_dflash2", repo)


def accept(repo: str | Path = REPO_ROOT):
    """The root ``accept_dflash2`` module (the target's choices after verified nodes, the walk)."""
    return _sibling("accept_dflash2", repo)


def attention(repo: str | Path = REPO_ROOT):
    """The root ``attention_dflash2`` module (the attention a verification forward runs under its mask)."""
    return _sibling("attention_dflash2", repo)


def holes(repo: str | Path = REPO_ROOT):
    """The root ``holes_dflash2`` module (ragged rows of a batch: holes, tail crops, compaction)."""
    return _sibling("holes_dflash2", repo)


def loop(repo: str | Path = REPO_ROOT):
    """The root ``loop_dflash2`` module (the decoding loop: every call, one row or many)."""
    return _sibling("loop_dflash2", repo)


def generation_of(drafter):
    """The ``generation_dflash2`` module of the drafter's OWN remote-code package.

    A drafter loaded from another folder runs that folder's generation code, which records its
    statistics in its own module; reading the root module's would silently give empty stats.
    """
    return _package_module(type(drafter).__module__, "generation_dflash2")


def proposer_of(drafter):
    """The ``proposer_dflash2`` module (block drafts, paths, trees) of the drafter's own package."""
    return _package_module(type(drafter).__module__, "proposer_dflash2")


def suffix_index_class(drafter):
    """The ``SuffixIndex`` class of the drafter's own package (its ``suffix_index`` setter accepts that class only), or
    None for drafter code from before the index."""
    return getattr(sys.modules[type(drafter).__module__], "SuffixIndex", None)


def costs_of(drafter):
    """The ``costs_dflash2`` module (step costs measured on the device) of the drafter's own package."""
    return _package_module(type(drafter).__module__, "costs_dflash2")


def ngram_of(drafter):
    """The ``ngram_dflash2`` module (hybrid n-gram proposer) of the drafter's own package."""
    return _package_module(type(drafter).__module__, "ngram_dflash2")


def config_module(repo: str | Path = REPO_ROOT):
    return _sibling("configuration_dflash2", repo)


def config_class(repo: str | Path = REPO_ROOT):
    return modeling(repo).DFlash2Config


def model_class(repo: str | Path = REPO_ROOT):
    return modeling(repo).DFlash2DraftModel


def load_drafter(path: str | Path = REPO_ROOT, **kwargs):
    """``AutoModel.from_pretrained(path, trust_remote_code=True)``; the shipped drafter by default."""
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(path), trust_remote_code=True, **kwargs)
