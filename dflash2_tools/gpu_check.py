"""A prepared check for the day a GPU is at hand: correctness on the device, then step costs at fixed acceptance.

    python -m dflash2_tools.gpu_check --out gpu-check                       # a CUDA device, realistic shapes
    python -m dflash2_tools.gpu_check --out /tmp/smoke --device cpu --tiny  # the CI smoke test (a minute on a CPU)

1. Correctness (fp32, greedy, the device): the plain call equals ``target.generate`` on tiny random llama, qwen3 and
   glm5_next targets (one path per step; tree mode too where it is exact), with flash-attention-2 when importable,
   and on a llama whose second half and LM head are offloaded to the CPU by accelerate; the sampling chi-square of
   the test suite on a 5-token vocabulary (p-value reported; a broken verifier gives ~0).
2. Step costs (bf16 on a GPU): random-weight targets of realistic shape -- a ~1.1B dense llama (TinyLlama's shape)
   and a small MoE (qwen3_moe) -- with a drafter of matching width whose proposals are FORCED to a fixed acceptance:
   each step it proposes ``a - 1`` tokens of the target's own greedy text and then a wrong one, so every step
   commits exactly ``a`` tokens, for a = 2, 3, 4 (the drafter's forward still runs: its cost is real). Wall clock
   of 128 new tokens against ``target.generate`` eager and with a static cache + ``torch.compile`` (compile time
   reported apart), medians after a warm-up; the plain call both ways too (eager dynamic, and static cache, which
   transformers' rule compiles on a GPU for both: like with like).

Writes ``results.json`` and ``step_costs.png`` to ``--out`` and prints a table. Needs no network and no weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from . import drafter as root
from .tiny_targets import FREE_COSTS, tiny_drafter, tiny_glm5_next, tiny_target

SHAPES = {  # name -> (architecture, config overrides); random weights, bf16
    "dense-1.1b": ("llama", dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                                 num_key_value_heads=4, vocab_size=32000)),
    "moe-small": ("qwen3_moe", dict(hidden_size=1024, intermediate_size=3072, moe_intermediate_size=384, num_hidden_layers=16,
                                    num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=32,
                                    num_experts_per_tok=4, decoder_sparse_step=1, vocab_size=32000)),
}
TINY_SHAPES = {
    "dense-tiny": ("llama", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=257)),
    "moe-tiny": ("qwen3_moe", dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                                   num_experts_per_tok=2, decoder_sparse_step=1, vocab_size=257)),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- 0. what travels ----------------------------------------------------------------------------------------

# transformers' model folders the check builds (and the embedded target's llama); the rest stay home
WHEEL_MODELS = ("auto", "llama", "qwen3", "qwen3_moe", "glm5_next", "qwen3_next")


def write_wheel(out_dir) -> Path:
    """The installed (tested) transformers as a wheel holding only ``WHEEL_MODELS`` of its ~550 model folders: ~2.5 MB
    instead of the 13 MB release wheel, so the check's file set stays well under a GPU machine's 64 MiB."""
    import zipfile

    import transformers

    package = Path(transformers.__file__).parent
    dist = package.parent / f"transformers-{transformers.__version__}.dist-info"
    path = Path(out_dir) / f"transformers-{transformers.__version__}-py3-none-any.whl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        for folder in (package, dist):
            for f in sorted(folder.rglob("*")):
                rel = f.relative_to(package.parent)
                if f.is_dir() or "__pycache__" in rel.parts:
                    continue
                if rel.parts[:2] == ("transformers", "models") and len(rel.parts) > 3 and rel.parts[2] not in WHEEL_MODELS:
                    continue
                wheel.write(f, rel.as_posix())
    return path


# ---- 1. correctness ------------------------------------------------------------------------------------------


@torch.no_grad()
def correctness(device: torch.device) -> list[dict]:
    gen = root.generation()
    rows = []
    flash = device.type == "cuda" and _flash_attention_available()
    for arch in ("llama", "qwen3", "glm5_next"):
        target = (tiny_glm5_next() if arch == "glm5_next" else tiny_target(arch)).to(device)
        extra = dict(target_layer_ids=[0, 2, 4], target_hidden_reduction="mean", conv_group_size=8) if arch == "glm5_next" else {}
        drafter = tiny_drafter(target, **extra).to(device)
        backends = ["sdpa"] + (["flash_attention_2"] if flash and arch != "glm5_next" else [])
        for backend in backends:
            if backend != "sdpa":
                target.set_attn_implementation(backend)
            for budget, cache in ([(None, None)] if arch == "glm5_next" else [(b, c) for c in (None, "static") for b in (None, 6)]):
                drafter.config.tree_budget = budget  # a static cache: compiled on a GPU (transformers' rule), as the target
                equal = 0
                for n in (1, 5, 17):
                    ids = torch.randint(1, 90, (1, n), generator=torch.Generator().manual_seed(n)).to(device)
                    want = target.generate(ids, max_new_tokens=24, do_sample=False)
                    got, _ = gen.dflash2_generate(target, drafter, ids, max_new_tokens=24, do_sample=False, cache_implementation=cache)
                    equal += bool(torch.equal(got, want))
                rows.append({"check": f"greedy {arch} {backend} tree_budget={budget} cache={cache or 'dynamic'}", "passed": equal == 3,
                             "detail": f"{equal}/3 equal"})
        del target, drafter
    rows.append(_offloaded(device))
    rows.extend(_batched(device))
    rows.append(_sampling(device))
    return rows


def _batched(device: torch.device) -> list[dict]:
    """A left-padded batch of four prompts of different lengths: on qwen3 a path or a tree per row, dynamic and static
    caches (compiled on a GPU); on glm5_next (linear attention: rows commit in lockstep, states replayed) one path per
    row. Every row equals the target's batched generate."""
    lengths = (1, 5, 9, 17)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 90, (n,), generator=g).tolist() for n in lengths]
    ids = torch.tensor([[0] * (max(lengths) - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (max(lengths) - len(p)) + [1] * len(p) for p in prompts], device=device)
    rows = []
    for arch in ("qwen3", "glm5_next"):
        target = (tiny_glm5_next() if arch == "glm5_next" else tiny_target(arch)).to(device)
        extra = dict(target_layer_ids=[0, 2, 4], target_hidden_reduction="mean", conv_group_size=8) if arch == "glm5_next" else {}
        drafter = tiny_drafter(target, **extra).to(device)
        for budget, cache in ([(None, None)] if arch == "glm5_next" else [(b, c) for c in (None, "static") for b in (None, 6)]):
            drafter.config.tree_budget = budget
            kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0, cache_implementation=cache)
            want = target.generate(**kw)
            got = target.generate(**kw, assistant_model=drafter)
            rows.append({"check": f"greedy {arch}, a batch of 4 prompts of different lengths, tree_budget={budget} "
                                  f"cache={cache or 'dynamic'}", "passed": bool(torch.equal(got, want)),
                         "detail": f"{int((got == want).all(-1).sum())}/4 rows equal"})
    return rows


def _flash_attention_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _offloaded(device: torch.device) -> dict:
    import tempfile

    from transformers import AutoModelForCausalLM

    target = tiny_target("llama")
    drafter = tiny_drafter(target).to(device)
    with tempfile.TemporaryDirectory() as tmp:
        target.save_pretrained(tmp)
        layers = target.config.num_hidden_layers
        away = "cpu" if device.type == "cuda" else "disk"  # on a CPU, "cpu" is not offloading: disk is
        device_map = {"model.embed_tokens": str(device), "model.rotary_emb": str(device), "model.norm": str(device), "lm_head": away}
        device_map.update({f"model.layers.{i}": str(device) if i < layers // 2 else away for i in range(layers)})
        dispatched = AutoModelForCausalLM.from_pretrained(tmp, device_map=device_map, offload_folder=f"{tmp}/offload").eval()
        ids = torch.tensor([[3, 5, 7, 9]], device=device)
        want = dispatched.generate(ids, max_new_tokens=16, do_sample=False)
        got = dispatched.generate(ids, assistant_model=drafter, max_new_tokens=16, do_sample=False)
    return {"check": "greedy llama, half the layers and the head offloaded", "passed": bool(torch.equal(got, want)), "detail": ""}


def _sampling(device: torch.device, samples: int = 300) -> dict:
    """The test suite's chi-square on a 5-token vocabulary: exact joint law of 3 tokens vs speculative samples."""
    import itertools

    v, n_new = 5, 3
    target = tiny_target("llama", vocab=v, hidden=48, layers=3, seed=5)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(0.35)
    target = target.to(device)
    target.generation_config.eos_token_id = None
    drafter = tiny_drafter(target, seed=7, mask_token_id=v - 1, selector_top_k=3, block_size=4, conv_group_size=16).to(device)
    with torch.no_grad():
        drafter.candidate_selector.hidden_projection.weight.normal_(0, 2.0)
    prompt = torch.tensor([[1, 3, 2]], device=device)
    expected = {}
    with torch.no_grad():
        for seq in itertools.product(range(v), repeat=n_new):
            p, ids = 1.0, prompt
            for tok in seq:
                p *= float(target(ids).logits[0, -1].float().softmax(-1)[tok])
                ids = torch.cat([ids, torch.tensor([[tok]], device=device)], 1)
            expected[seq] = p
    counts = {}
    for seed in range(samples):
        torch.manual_seed(seed)
        out = target.generate(prompt, assistant_model=drafter, do_sample=True, top_k=0, max_new_tokens=n_new, pad_token_id=0)
        cell = tuple(out[0, prompt.shape[1]:].tolist())
        counts[cell] = counts.get(cell, 0) + 1
    stat, dof, pooled_o, pooled_e = 0.0, -1, 0.0, 0.0
    for cell, p in expected.items():
        e, o = p * samples, counts.get(cell, 0)
        if e < 5:
            pooled_o, pooled_e = pooled_o + o, pooled_e + e
            continue
        stat, dof = stat + (o - e) ** 2 / e, dof + 1
    if pooled_e > 0:
        stat, dof = stat + (pooled_o - pooled_e) ** 2 / pooled_e, dof + 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), torch.tensor(stat / 2.0, dtype=torch.float64)))
    return {"check": f"sampling chi-square ({samples} samples)", "passed": p_value > 1e-3, "detail": f"p = {p_value:.3g}"}


# ---- 2. step costs at forced acceptance ------------------------------------------------------------------------


def build_target(shape: tuple, device, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    arch, overrides = shape
    cfg = AutoConfig.for_model(arch, max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=None,
                               bos_token_id=0, pad_token_id=0, **overrides)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").eval()
    return model


def forced_acceptance(gen_module, reference: torch.Tensor, accept: int):
    """Patch the candidate generator so each draft is ``accept - 1`` tokens of ``reference`` then a wrong token."""
    original = gen_module.Proposer.draft_block

    def draft(self, anchors, n_draft):
        real = original(self, anchors, n_draft)  # the drafter's forward runs: its cost is real
        pos = self.lengths[0]  # one row: its committed length
        right = reference[0, pos : pos + accept - 1].to(real.tokens.device)
        wrong = (reference[0, pos + accept - 1 : pos + accept] + 1) % self.config.vocab_size if pos + accept - 1 < reference.shape[1] else right[:0]
        tokens = torch.cat([right, wrong])[None][:, :n_draft]  # [1, <= accept]
        return gen_module.Draft(tokens, None, torch.ones_like(tokens, dtype=torch.float))

    return original, draft


def timed(device, fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.no_grad()
def step_costs(device: torch.device, shapes: dict, new_tokens: int, repeats: int, accepts: list[int]) -> list[dict]:
    gen = root.generation()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for name, shape in shapes.items():
        target = build_target(shape, device, dtype)
        tcfg = target.config
        drafter = tiny_drafter(target, num_hidden_layers=2, num_attention_heads=8 if tcfg.hidden_size >= 512 else 4,
                               num_key_value_heads=4 if tcfg.hidden_size >= 512 else 2, head_dim=tcfg.hidden_size // 16,
                               intermediate_size=tcfg.hidden_size * 2, conv_group_size=16, selector_rank=64, selector_top_k=8,
                               block_size=8, target_layer_ids=[1, tcfg.num_hidden_layers // 2, tcfg.num_hidden_layers - 2],
                               hybrid_ngram={"costs": FREE_COSTS, "num_tokens": 0}).to(device, dtype)
        ids = torch.randint(1, tcfg.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0)).to(device)
        kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        reference = target.generate(ids, **kw)
        eager = timed(device, lambda: target.generate(ids, **kw), repeats)
        t0 = time.perf_counter()
        target.generate(ids, cache_implementation="static", **kw)  # compiles on a GPU (transformers' compile_config)
        compile_s = time.perf_counter() - t0
        compiled = timed(device, lambda: target.generate(ids, cache_implementation="static", **kw), repeats)
        row = {"target": name, "dtype": str(dtype).removeprefix("torch."), "target_eager_s": eager, "target_static_compiled_s": compiled,
               "first_static_call_s (compile)": compile_s, "speculative": {}}
        for accept in accepts:
            original, patched = forced_acceptance(gen, reference, accept)
            gen.Proposer.draft_block = patched
            try:
                out, stats = gen.dflash2_generate(target, drafter, ids, **kw)
                seconds = timed(device, lambda: target.generate(ids, assistant_model=drafter, **kw), repeats)
                t1 = time.perf_counter()  # like with like: the plain call on a static cache (compiled on a GPU, as the target)
                static_out = target.generate(ids, assistant_model=drafter, cache_implementation="static", **kw)
                static_first = time.perf_counter() - t1
                static_seconds = timed(device, lambda: target.generate(ids, assistant_model=drafter, cache_implementation="static", **kw),
                                       repeats)
            finally:
                gen.Proposer.draft_block = original
            # greedy equality is asserted in fp32 above; in bf16 a multi-token verification may round differently
            row["speculative"][accept] = {"seconds": seconds, "tokens_per_forward": stats.mean_acceptance_length,
                                          "same_as_target": bool(torch.equal(out, reference)),
                                          "static_same_as_target": bool(torch.equal(static_out, reference)),
                                          "speedup_vs_eager": eager / seconds, "speedup_vs_static_compiled": compiled / seconds,
                                          "static_seconds": static_seconds, "first_static_call_s (compile)": static_first,
                                          "static_speedup_vs_static_compiled": compiled / static_seconds}
        rows.append(row)
        del target, drafter
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 3.5), squeeze=False)
    for ax, row in zip(axes[0], rows):
        accepts = list(row["speculative"])
        ax.bar([f"a={a}" for a in accepts], [row["speculative"][a]["speedup_vs_eager"] for a in accepts], label="vs target eager")
        ax.plot([f"a={a}" for a in accepts], [row["speculative"][a]["speedup_vs_static_compiled"] for a in accepts], "ko-",
                label="vs target static+compile")
        ax.plot([f"a={a}" for a in accepts], [row["speculative"][a]["static_speedup_vs_static_compiled"] for a in accepts], "rs--",
                label="static(+compile) plain call vs the same target")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"{row['target']} ({row['dtype']})")
        ax.set_ylabel("speedup of the plain call")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=False)
    ap.add_argument("--write-wheel", metavar="DIR", help="only write the trimmed transformers wheel into DIR (what travels)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and few tokens (the CPU smoke test)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--accepts", type=int, nargs="+", default=[2, 3, 4])
    args = ap.parse_args(argv)
    if args.write_wheel:
        print(write_wheel(args.write_wheel))
        return
    if not args.out:
        ap.error("--out is required")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: pass --device cpu --tiny for the smoke test")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    checks = correctness(device)
    for c in checks:
        print(f"{'PASS' if c['passed'] else 'FAIL'}  {c['check']}  {c['detail']}")
    shapes = TINY_SHAPES if args.tiny else SHAPES
    new_tokens = min(args.new_tokens, 24) if args.tiny else args.new_tokens
    costs = step_costs(device, shapes, new_tokens, 1 if args.tiny else args.repeats, args.accepts)
    for row in costs:
        spec = "  ".join(f"a={a}: {v['speedup_vs_eager']:.2f}x / {v['speedup_vs_static_compiled']:.2f}x / "
                         f"{v['static_speedup_vs_static_compiled']:.2f}x" for a, v in row["speculative"].items())
        print(f"{row['target']:11s} target eager {row['target_eager_s']:.2f} s, static+compile {row['target_static_compiled_s']:.2f} s"
              f" (first call {row['first_static_call_s (compile)']:.1f} s); plain call vs eager / vs compiled, "
              f"static plain call vs compiled: {spec}")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    import transformers

    result = {"device": device_name, "torch": torch.__version__, "transformers": transformers.__version__,
              "transformers_path": transformers.__file__, "checks": checks, "step_costs": costs,
              "seconds": time.perf_counter() - t0, "new_tokens": new_tokens}
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    plot(costs, out / "step_costs.png")
    print(f"wrote {out / 'results.json'} and {out / 'step_costs.png'} in {result['seconds']:.0f} s")
    if not all(c["passed"] for c in checks):
        raise SystemExit("a correctness check failed (see above)")


if __name__ == "__main__":
    main()
