"""Our checkpoint in llama.cpp's DFlash 2: build, convert, run, and compare with the plain call.

    python -m dflash2_tools.llamacpp compare --prompt-set sharegpt-dev --limit 4

``compare`` does everything, each step once and cached (``~/.cache/dflash2/llama.cpp``,
``DFLASH2_CACHE`` overrides):

1. ``build``: llama.cpp from the PyPI sdist ``llama-cpp-python==0.3.36`` (it vendors a llama.cpp
   tree with DFlash 2), configured with cmake and built with the machine's C++ compiler
   (``llama-speculative-simple``, ``llama-bench``; ~15 min on 2 cores, resumable: cmake builds
   incrementally);
2. ``convert``: the drafter folder to GGUF with llama.cpp's own ``convert_hf_to_gguf.py
   --target-model-dir <the embedded target's HF folder>``;
3. ``run``: llama.cpp's speculative decoding of the embedded target's Q4_1 GGUF (the same file the
   transformers target is dequantised from) with the drafter, greedy, on a prompt set:
   per prompt tokens per target forward and tokens/s (``--spec-draft-n-max block_size - 1``), llama.cpp's
   own n-gram drafting (``ngram-simple``), and the target alone (``llama-bench``);
4. the same prompts through our plain ``target.generate(..., assistant_model=drafter)`` call
   (block draft only, the hybrid's n-gram off, the whole block verified: what llama.cpp does),
   side by side, and our drafter replayed on llama.cpp's own text (``replay_acceptance``): the two
   targets' greedy texts part within a few tokens on many prompts, and only the same text makes
   the two implementations comparable.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from tqdm import tqdm

from . import drafter as root
from .prompts import load_prompt_set
from .target import EMBEDDED_TARGET, cache_dir, embedded_target_dir, load_target, smollm2_gguf_path

SDIST = "llama-cpp-python==0.3.36"
BINARIES = ("llama-speculative-simple", "llama-bench")


def llamacpp_dir() -> Path:
    return cache_dir() / "llama.cpp"


def source_dir() -> Path:
    """The vendored llama.cpp tree of the sdist, downloaded and unpacked once."""
    src = llamacpp_dir() / "src"
    if (src / "CMakeLists.txt").is_file():
        return src
    download = llamacpp_dir() / "sdist"
    download.mkdir(parents=True, exist_ok=True)
    if not list(download.glob("*.tar.gz")):
        print(f"downloading the {SDIST} sdist (PyPI) ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST, "-d", str(download)],
                       check=True)
    archive = next(download.glob("*.tar.gz"))
    with tarfile.open(archive) as tar:
        # <sdist>/vendor/llama.cpp/<path>: keep <path> (the top folder's own vendor tree only)
        members = [m for m in tar.getmembers() if m.name.count("/") >= 3 and m.name.split("/", 3)[1:3] == ["vendor", "llama.cpp"]]
        tmp = llamacpp_dir() / "src.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        for m in tqdm(members, desc="unpacking llama.cpp", unit="file"):
            m.name = m.name.split("/", 3)[3]
            if m.name:
                tar.extract(m, tmp, filter="data")
    tmp.rename(src)
    return src


def build() -> Path:
    """Configure and build llama.cpp's speculative example once; returns the bin folder."""
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"building llama.cpp needs {' and '.join(missing)} on PATH: apt-get install cmake g++ (or your platform's equivalent)")
    src, out = source_dir(), llamacpp_dir() / "build"
    bin_dir = out / "bin"
    if all((bin_dir / b).is_file() for b in BINARIES):
        return bin_dir
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_UI=OFF",
             "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DGGML_NATIVE=ON"]
    subprocess.run(["cmake", "-S", str(src), "-B", str(out), *flags], check=True, stdout=subprocess.DEVNULL)
    cmd = ["cmake", "--build", str(out), "-j", str(max(1, len(os.sched_getaffinity(0)))), "--target", *BINARIES]
    bar = tqdm(total=100, desc="building llama.cpp", unit="%")
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        log = []
        for line in proc.stdout:
            log.append(line)
            m = re.match(r"\[\s*(\d+)%\]", line)
            if m:
                bar.update(int(m.group(1)) - bar.n)
    bar.close()
    if proc.returncode:
        raise SystemExit("llama.cpp build failed; the last lines:\n" + "".join(log[-30:]))
    return bin_dir


def convert(drafter_dir: str | Path, out: Path | None = None) -> Path:
    """The drafter folder as a GGUF, by llama.cpp's own converter (against the embedded target's HF folder)."""
    drafter_dir = Path(drafter_dir).resolve()
    out = out or llamacpp_dir() / f"drafter-{drafter_dir.name or 'root'}-f32.gguf"
    weights = drafter_dir / "model.safetensors"
    if out.is_file() and out.stat().st_mtime > weights.stat().st_mtime:
        return out
    missing = [m for m in ("sentencepiece",) if importlib.util.find_spec(m) is None]
    if missing:  # llama.cpp's converter reads a llama-family target's vocabulary with it
        raise SystemExit(f"llama.cpp's converter needs {', '.join(missing)}: pip install {' '.join(missing)}")
    src = source_dir()
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
    cmd = [sys.executable, str(src / "convert_hf_to_gguf.py"), str(drafter_dir), "--target-model-dir", str(embedded_target_dir()),
           "--outfile", str(out), "--outtype", "f32"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"llama.cpp's converter failed on {drafter_dir}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return out


def parse_speculative_log(text: str) -> dict:
    """The counters ``llama-speculative-simple`` prints at the end of a run."""
    def number(pattern):
        m = re.search(pattern, text)
        return float(m.group(1)) if m else None

    n_predict, n_accept = number(r"n_predict\s*=\s*(\d+)"), number(r"n_accept\s*=\s*(\d+)")
    if n_predict is None or n_accept is None:
        raise RuntimeError("llama-speculative-simple printed no n_predict / n_accept:\n" + text[-3000:])
    return {
        "new_tokens": int(n_predict),
        "drafted": int(number(r"n_drafted\s*=\s*(\d+)") or 0),
        "accepted": int(n_accept),
        # each step commits accepted + 1 tokens: steps = n_predict - n_accept target forwards
        "acceptance_length": n_predict / max(n_predict - n_accept, 1),
        "tok_per_s": number(r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+) t/s"),
    }


def target_alone_tok_per_s(bin_dir: Path, n_new: int, threads: int, depth: int = 0, repetitions: int = 5) -> float:
    """llama.cpp decoding the target alone (``llama-bench``, ``n_new`` tokens after ``depth`` context tokens)."""
    cmd = [str(bin_dir / "llama-bench"), "-m", str(smollm2_gguf_path()), "-p", "0", "-n", str(n_new), "-d", str(depth),
           "-r", str(repetitions), "-t", str(threads), "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(json.loads(done.stdout)[0]["avg_ts"])


def run_llamacpp(bin_dir: Path, prompt_text: str, draft_gguf: Path | None, spec_type: str, n_new: int, threads: int,
                 n_draft: int | None = None) -> dict:
    """Greedy speculative decoding of one prompt by ``llama-speculative-simple``."""
    cmd = [str(bin_dir / "llama-speculative-simple"), "-m", str(smollm2_gguf_path()), "-p", prompt_text, "-n", str(n_new),
           "--temp", "0", "-t", str(threads), "-c", "2048", "--seed", "0", "--spec-type", spec_type]
    if draft_gguf is not None:
        cmd += ["-md", str(draft_gguf)]
    if n_draft is not None:
        cmd += ["--spec-draft-n-max", str(n_draft)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd[:1])} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result = parse_speculative_log(done.stdout + done.stderr)
    result["text"] = done.stdout.rsplit(ASSISTANT_TURN, 1)[-1]  # stdout echoes the prompt, then the generated text
    return result


ASSISTANT_TURN = "<|im_start|>assistant\n"


def first_divergence_token(tokenizer, ours: str, theirs: str) -> int | None:
    """Our token index at which llama.cpp's greedy text first differs from ours (None: the same text)."""
    n = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if n is None:
        return None
    return len(tokenizer(ours[:n], add_special_tokens=False)["input_ids"])


def replay_acceptance(drafter, target, tokenizer, prompt_text: str, continuation: str, max_new_tokens: int) -> float:
    """Tokens per target forward our drafter would get if the greedy target's text were ``continuation``.

    Where llama.cpp's target (Q4_1, quantised activations) and ours (its fp32 dequantisation) write
    different text, the two acceptances are measured on different text. Replaying our drafter on
    llama.cpp's text (our target's features of that text, the anchors a greedy verifier visits)
    separates what the text explains from what the implementations do differently.
    """
    import torch

    from .training.evaluate import response_acceptance
    from .training.forward import LossHead
    from .training.features import target_forward
    from .training.loss import greedy_verifier_steps

    prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    response = tokenizer(continuation, add_special_tokens=False)["input_ids"][:max_new_tokens]
    if len(response) < 2:
        raise ValueError(f"a continuation of {len(response)} token(s) has no block to replay")
    tokens = torch.tensor([prompt + response])  # [1, T]
    lengths = torch.tensor([tokens.shape[1]])
    cfg = drafter.config
    with torch.no_grad():
        features, _, _ = target_forward(target, tokens, lengths, cfg.target_layer_ids, cfg.target_hidden_reduction)
        acc = response_acceptance(drafter, target, LossHead.of(drafter, target), tokens, lengths, len(prompt), features,
                                  contextlib.nullcontext)
    method = "selector" if "selector" in acc else "argmax"
    steps = greedy_verifier_steps(acc[method].tolist())
    return sum(steps) / len(steps)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["build", "convert", "compare"])
    ap.add_argument("--drafter", default=str(root.REPO_ROOT))
    ap.add_argument("--prompt-set", default="sharegpt-dev")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the per-prompt table as JSON here")
    args = ap.parse_args(argv)
    bin_dir = build()
    if args.command == "build":
        print(bin_dir)
        return
    gguf = convert(args.drafter)
    if args.command == "convert":
        print(gguf)
        return
    compare(args, bin_dir, gguf)


def compare(args, bin_dir: Path, gguf: Path) -> None:
    import torch

    target, tokenizer = load_target(EMBEDDED_TARGET, dtype=torch.float32)
    drafter = root.load_drafter(args.drafter, dtype=torch.float32).eval()
    gen = root.generation_of(drafter)
    drafter.config.hybrid_ngram = {**(drafter.config.hybrid_ngram or {}), "costs": {"multi_token_step": 0.0, "per_token": 0.0, "draft": 0.0}}
    alone = target_alone_tok_per_s(bin_dir, args.max_new_tokens, args.threads)
    print(f"llama.cpp, target alone (llama-bench, {args.max_new_tokens} tokens): {alone:.1f} tok/s", flush=True)
    rows = []
    for rec in tqdm(load_prompt_set(args.prompt_set)[: args.limit], desc="llama.cpp vs transformers", unit="prompt"):
        text = tokenizer.apply_chat_template(rec["messages"], add_generation_prompt=True, tokenize=False)
        inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        with gen.collect_stats() as runs:  # what llama.cpp does: the block draft, every drafted token verified (no costs)
            out = target.generate(**inputs, assistant_model=drafter, do_sample=False, max_new_tokens=args.max_new_tokens,
                            prompt_lookup_num_tokens=0)
        ours = runs[-1]
        ours_text = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])
        row = {"prompt_id": rec["id"], "transformers dflash2 acceptance": ours.mean_acceptance_length}
        block = drafter.config.block_size - 1
        texts = {}
        for name, draft, spec, n_draft in (("llama.cpp+dflash2", gguf, "draft-dflash", block), ("llama.cpp+ngram", None, "ngram-simple", None)):
            result = run_llamacpp(bin_dir, text, draft, spec, args.max_new_tokens, args.threads, n_draft)
            row[f"{name} acceptance"] = result["acceptance_length"]
            row[f"{name} tok/s"] = result["tok_per_s"]
            texts[name] = result["text"]
        # both greedy: where the two targets' texts part (Q4_1 with quantised activations vs its fp32 dequantisation)
        theirs = texts["llama.cpp+dflash2"]
        row["texts differ from token"] = first_divergence_token(tokenizer, ours_text, theirs)
        # the same weights on the same text: our drafter replayed on llama.cpp's text
        row["ours on llama.cpp's text"] = replay_acceptance(drafter, target, tokenizer, text, theirs, args.max_new_tokens)
        rows.append(row)
        print(json.dumps(row), flush=True)
    keys = list(rows[0]) if rows else []
    print("\n| " + " | ".join(keys) + " |\n|" + " --- |" * len(keys))
    for r in rows:
        print("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in r.values()) + " |")
    gaps = [abs(r["llama.cpp+dflash2 acceptance"] - r["ours on llama.cpp's text"]) for r in rows]
    if gaps:
        print(f"\nsame weights, same text (llama.cpp's): |llama.cpp - ours| tokens per forward, mean {sum(gaps) / len(gaps):.3f}, "
              f"max {max(gaps):.3f} over {len(gaps)} prompts")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "llama.cpp target alone tok/s": alone, "rows": rows,
                                              "same-text gap mean": sum(gaps) / max(len(gaps), 1), "same-text gap max": max(gaps, default=0.0)},
                                             indent=1))


if __name__ == "__main__":
    main()
