"""What a decoding step costs on THIS device, measured once per machine (kept on disk), for the rule and the tree choice.

The rule (ngram_dflash2.HybridRule) weighs expected tokens against cost in one-token target forwards: verifying L
drafted tokens costs ``verify(L)``, a draft ``draft``. Those differ by orders of magnitude between a compute-bound
CPU, a CPU with native bf16 and a GPU, and on a CPU the cost is not a line in L (flat to 2 tokens, a step to 4,
shallower after), so at first use per (device, dtype, target, drafter) we time target forwards of the widths a step
runs (1, 2, 4, 8, 16, the longest linear verification, a 32-node tree), each over a 128-token cache like a step's,
and one draft (drafter forward + head + selector walk), with CUDA events on a GPU; each the fastest of 3-8 rounds
(noise only ever adds time). The widths' costs are the ``curve`` the rule interpolates; ``multi_token_step`` and
``per_token`` are the line through 2 tokens and the longest verification, for reports. ``hybrid_ngram["costs"]``
overrides; the per-device table (``table_step_costs``) is the fallback when a measurement cannot run.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import platform
import time

import torch

from .ngram_dflash2 import StepCosts

# Every width is timed over a context like a step's (attention and the cache's growth are part of a step's cost), the
# fastest of MIN_ROUNDS..MAX_ROUNDS rounds within MEASURE_SECONDS: two short measurements in two processes had flipped
# a batch's rule near break-even (docs/bench-batch-fp32-champ16), and one linear fit through two widths, each the
# median of two rounds, had put a 13-token verification at 3.7 one-token forwards where a step measured 2.2.
MEASURE_SECONDS, MIN_ROUNDS, MAX_ROUNDS = 1.5, 3, 8
CONTEXT_TOKENS = 128
TREE_WIDTH = 33  # the largest "auto" tree (32 nodes) and its root
COST_MODEL = "curve-2"  # part of the disk cache's key: costs measured by an older model are measured again
_MEASURED: dict[tuple, dict] = {}  # per process: key -> costs
# ...and on disk, so that a new process (a server's restart, the next script) does not measure again: one JSON file,
# keyed by the device's model (CPU model and threads, or GPU name), dtype, target, drafter and torch version.
# DFLASH2_COST_CACHE names the file; empty turns it off.
COST_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "dflash2", "step_costs.json")


BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=None)
def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read().split()
    except OSError:  # not Linux: assume emulated bf16
        return False
    return any(flag in flags for flag in BF16_CPU_FLAGS)


def table_step_costs(device: torch.device, dtype: torch.dtype) -> dict:
    """The fallback: costs by device class, from profiles of SmolLM2-135M on 2-core CPUs (docs/evaluation.md).

    fp32 on an AVX2 EPYC: a 1-token forward 59 ms and 2 / 4 / 8 / 16 tokens 1.69 / 1.77 / 2.10 / 2.16 of it,
    the draft ~0.25; native bf16 (AVX-512 bf16): an 8-token verification 55-60 ms against 51-56 ms, the draft
    10-11 ms; emulated bf16 (AVX2): each extra token ~0.38, the draft 0.55. A GPU: verification assumed free.
    """
    if torch.device(device).type != "cpu":
        return {"multi_token_step": 0.0, "per_token": 0.0, "draft": 0.1}
    if dtype == torch.float32:
        return {"multi_token_step": 0.65, "per_token": 0.035, "draft": 0.25}
    if cpu_has_native_bf16():
        return {"multi_token_step": 0.05, "per_token": 0.005, "draft": 0.2}
    return {"multi_token_step": 0.0, "per_token": 0.38, "draft": 0.55}


def fit_costs(t1: float, t2: float, tn: float, n: int, draft: float) -> dict:
    """Cost-model numbers (in one-token forwards) from medians of 1-, 2- and ``n``-token forwards and a draft."""
    c2, cn = t2 / t1, tn / t1
    per_token = max(0.0, (cn - c2) / max(n - 2, 1))
    multi = max(0.0, c2 - 1.0 - per_token)
    return {"multi_token_step": round(multi, 4), "per_token": round(per_token, 4), "draft": round(draft / t1, 4)}


class _Timer:
    """Elapsed seconds of a callable: CUDA events on a GPU (no host sync inside the timed region), else perf_counter."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def _cache_key(target, drafter, device, dtype, rows: int = 1) -> tuple:
    tcfg = target.config.get_text_config()
    return (COST_MODEL, rows, str(device), str(dtype), type(target).__name__, getattr(target.config, "_name_or_path", ""),
            tcfg.hidden_size, tcfg.num_hidden_layers, tcfg.vocab_size, drafter.config.block_size, drafter.config.num_hidden_layers)


def _machine(device) -> str:
    """The device's model: a GPU's name, or the CPU's model name and the threads torch uses."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name} x{torch.get_num_threads()}"


def _disk_costs(key: tuple, device, costs: dict | None = None) -> dict | None:
    """Read the costs stored for ``key`` on this device model (None: none), or store ``costs``; never fails a call."""
    path = os.environ.get("DFLASH2_COST_CACHE", COST_CACHE)
    if not path:
        return None
    name = repr((*key, _machine(device), torch.__version__))
    try:
        stored = {}
        if os.path.exists(path):
            with open(path) as f:
                stored = json.load(f)
        if costs is None:
            return stored.get(name)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump({**stored, name: costs}, f, indent=1)
        os.replace(path + ".tmp", path)  # the whole file or the old one
    except (OSError, ValueError):
        return None
    return costs


@torch.no_grad()
def measure_step_costs(target, drafter, lm_head, device: torch.device, rows: int = 1) -> dict:
    """Time the target's forwards at every width a step runs and one draft; return the costs (module doc).
    ``rows``: of a batch that many rows (each forward then runs rows x n tokens; the unit is a plain batched step)."""
    cfg = drafter.config
    block = cfg.block_size
    longest = 1 + max(block - 1, cfg.hybrid_settings()["num_tokens"])  # the most tokens a linear step verifies
    widths = sorted({1, 2, 4, 8, 16, longest, TREE_WIDTH})
    tdevice = target.get_input_embeddings().weight.device
    tdevice = tdevice if tdevice.type != "meta" else device
    rng = torch.Generator().manual_seed(0)  # its own: a measurement inside a sampling call leaves the global RNG alone
    ids = torch.randint(0, cfg.vocab_size, (rows, widths[-1]), generator=rng).to(tdevice)  # [rows, n_max]
    layers = [i + 1 for i in cfg.target_layer_ids]
    dtype = next(drafter.parameters()).dtype
    noise = torch.randn(rows, block, cfg.hidden_size, generator=rng).to(device, dtype)  # [rows, B, H]
    context = torch.randn(rows, 4, len(cfg.target_layer_ids) * cfg.hidden_size, generator=rng).to(device, dtype)  # [rows, 4, n*H]
    anchor = ids[:, -1].to(device)
    filler = torch.randint(0, cfg.vocab_size, (rows, CONTEXT_TOKENS), generator=rng).to(tdevice)  # [rows, C]
    past = target(input_ids=filler, use_cache=True).past_key_values

    def forward(n):
        return lambda cache: target(input_ids=ids[:, :n], past_key_values=cache, use_cache=True, output_hidden_states=layers)

    def draft(_):
        hidden = drafter(noise_embeds=noise, context_hidden_states=context).last_hidden_state[:, 1:]  # [rows, B-1, H]
        logits = drafter.draft_logits(lm_head, hidden).float()  # [rows, B-1, V']
        if drafter.candidate_selector is not None:
            vocab_ids = getattr(lm_head, "vocab_ids", None)
            drafter.candidate_selector.walk(hidden, logits, anchor, 0.0, vocab_ids=None if vocab_ids is None else vocab_ids.to(device))
        else:
            logits.argmax(-1)

    timer = _Timer(device)
    jobs = {**{n: forward(n) for n in widths}, "draft": draft}

    def timed(name) -> float:
        # each forward over its own copy of the context (made outside the timing): a stateful layer cannot crop back
        cache = copy.deepcopy(past) if name != "draft" else None
        return timer(lambda: jobs[name](cache))

    for name in jobs:  # warm-up: every shape once (kernels chosen and buffers grown outside the timing)
        timed(name)
    times = {name: [] for name in jobs}
    spent = time.perf_counter()
    for round_ in range(MAX_ROUNDS):
        for name in jobs:
            times[name].append(timed(name))
        if round_ + 1 >= MIN_ROUNDS and time.perf_counter() - spent > MEASURE_SECONDS:
            break
    fastest = {name: min(v) for name, v in times.items()}
    t1 = fastest[1]
    costs = fit_costs(t1, fastest[2], fastest[longest], longest, fastest["draft"])
    # a wider forward never costs less than a narrower one: timing noise must not make the curve go down
    curve, top = [], 0.0
    for n in widths:
        top = max(top, fastest[n] / t1)
        curve.append([n, round(top, 4)])
    costs["curve"] = curve
    costs["one_token_ms"] = round(t1 * 1000, 3)
    return costs


def step_costs(target, drafter, lm_head, device: torch.device, rows: int = 1) -> tuple[dict, str]:
    """(costs, source) for this call, by ``hybrid_ngram["costs"]``: a dict: those ("config"); ``"table"``: the per-device
    table; ``"measured"`` or None (the default): this device's (the table if measuring fails). Until the curve, an fp32
    CPU defaulted to the table, which a line through two widths had beaten; the curve beats the table there by 9-13%
    (docs/hybrid/policies.md). ``rows`` > 1: a batch's costs, in plain batched steps (measured at the batch's size,
    also for ``"table"``; a configured dict is scaled by ``batch_costs``). ``lm_head``: the draft head (None: built)."""
    configured = drafter.config.hybrid_settings()["costs"]
    dtype = next(drafter.parameters()).dtype
    if isinstance(configured, dict):
        return dict(configured), "config"
    if rows == 1 and configured == "table":
        return table_step_costs(device, dtype), "table"
    key = _cache_key(target, drafter, device, dtype, rows)
    if key not in _MEASURED:
        costs = _disk_costs(key, device)  # measured by an earlier process on this machine
        if costs is None:
            try:
                lm_head = lm_head if lm_head is not None else drafter.draft_head(target.get_output_embeddings())
                costs = measure_step_costs(target, drafter, lm_head, device, rows)
            except (RuntimeError, ValueError, TypeError) as error:  # a target whose bare forward we cannot call: the table
                return {**table_step_costs(device, dtype), "error": f"{type(error).__name__}: {error}"[:200]}, "table"
            _disk_costs(key, device, costs)
        _MEASURED[key] = costs
    return dict(_MEASURED[key]), "measured" if rows == 1 else f"measured at batch {rows}"


def batch_step_costs(costs: StepCosts, rows: int) -> StepCosts:
    """One row's costs (unit: a one-token forward of one row) -> a batch's (unit: a plain step of ``rows`` rows).

    The cost model prices a forward over m >= 2 tokens at ``1 + multi_token_step + per_token * (m - 1)`` one-token
    forwards. A batch verifying L drafted tokens per row runs ``rows * (1 + L)`` tokens where a plain batched step
    runs ``rows``: ``1 + per_token * rows * L / D`` plain steps, with D the plain step's own price. A draft is
    taken to scale like the target (its share of a step stays ``draft``)."""
    if rows == 1:
        return costs
    plain = 1.0 + costs.multi_token_step + costs.per_token * (rows - 1)
    return StepCosts(multi_token_step=0.0, per_token=costs.per_token * rows / plain, draft=costs.draft)


def batch_costs(target, drafter, lm_head, device, rows: int) -> tuple[StepCosts, dict, str]:
    """(the batch's StepCosts, the costs as found, their source) for a batch of ``rows``: measured at this batch
    size they are already the batch's; a configured dict or the one-row table is scaled (``batch_step_costs``)."""
    costs, source = step_costs(target, drafter, lm_head, device, rows)
    step = StepCosts(**rule_costs(costs))
    if source == "config" or source == "table":
        step = batch_step_costs(step, rows)
    return step, costs, source


def rule_costs(costs: dict) -> dict:
    """What ``StepCosts`` takes: the three numbers, and a measurement's curve (it also carries its one-token time)."""
    out = {k: costs[k] for k in ("multi_token_step", "per_token", "draft")}
    if costs.get("curve"):
        out["curve"] = tuple((int(w), float(c)) for w, c in costs["curve"])
    return out


__all__ = ["batch_costs", "batch_step_costs", "cpu_has_native_bf16", "fit_costs", "measure_step_costs", "rule_costs", "step_costs", "table_step_costs"]
