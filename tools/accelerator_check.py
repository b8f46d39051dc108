"""The accelerator check: on a machine with a GPU (or TPU), one command that says what runs there
and how fast, and writes the figures for BENCHMARKS.md.

    python tools/accelerator_check.py --out DIR      # or: just accelerator-check DIR

Each part runs in its own process (a crash or an out-of-memory in one leaves the others' figures),
and its result lands in ``DIR/accelerator_check.json``; ``DIR/accelerator_check.md`` is the table.

1. ``env``: JAX's version, the devices, the device kind and its peak memory bandwidth.
2. ``kernels``: the ``gpu``-marked kernel tests (``tests/pallas_kernels``), which compile the
   Pallas kernels for the device and compare them with the pure-jnp reference.
3. ``greedy``: a model of SmolLM2-135M's shape with seeded random float32 weights (the packaged
   GGUF does not travel to a machine without network, see below) decodes 24 greedy tokens for
   three prompts through the whole engine on the device and, in a child process, on the CPU;
   the tokens must be equal. The device runs with ``jax_default_matmul_precision=highest`` (a
   random model's logits are nearly flat, so TF32 rounding alone could pick another token); the
   same run at the default precision is reported beside it.
4. ``throughput``: single-stream decode of the same shape in bfloat16 through the engine (256
   tokens, EOS ignored), with the default ``--decode-steps`` and with 8.
5. ``roofline``: the same weights multiplied by XLA's plain dots alone (no attention, norms or
   sampling), the bandwidth a step could reach with the dots XLA emits.
6. ``step``: ``tools/bench_decode_step.py`` on a Llama-3-8B-shaped model (its layer shapes, vocab
   and head; ``--layers`` of its 32 layers, 8 by default so it is made and loaded in seconds) in
   bfloat16 and re-quantized to Q4_0, with the kernels the runtime chooses and with the Pallas
   kernels forced (``--pallas``), at 1 and 64 sequences of 1,024 positions each, with the
   memory-bandwidth utilization of each step: the bytes a step must read (every weight but the
   embedding table, plus the KV cache of every sequence) over the step time and the device's peak.
   ``--step-xla-flags FLAGS`` adds the bfloat16 runs again with FLAGS appended to ``XLA_FLAGS``
   (labelled ``+xla-flags``), to try one of XLA's options beside the default in the same call.

Random models are made with transformers on the device machine itself (PyTorch is there). A
machine without network needs this repository and, where missing, wheels of the runtime's pure
Python dependencies (gguf, litestar, platformdirs, ...), carried as the README's "Accelerators"
section says.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [[1, 5, 9, 13, 200], [7, 7, 7], list(range(40, 75))]
GREEDY_TOKENS = 24
THROUGHPUT_TOKENS = 256

# Peak memory bandwidth by device kind (bytes/s), from the vendors' data sheets.
PEAK_BANDWIDTH = {
    "H100 80GB HBM3": 3.35e12,  # SXM
    "H100 PCIe": 2.0e12,
    "H100 NVL": 3.9e12,
    "H200": 4.8e12,
    "A100-SXM4-80GB": 2.039e12,
    "A100-SXM4-40GB": 1.555e12,
    "L4": 0.3e12,
    "TPU v5 lite": 0.819e12,
    "TPU v5e": 0.819e12,
    "TPU v6 lite": 1.64e12,
}

SMOLLM2 = dict(
    architectures=["LlamaForCausalLM"],
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)
LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"],
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
TINY = dict(  # --tiny: the same flow on shapes a CPU runs in seconds (to test the tool itself)
    architectures=["LlamaForCausalLM"],
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


# -- making random models (run in a child process: PyTorch then never shares the device) ---------
def make_model(folder: Path, config: dict, dtype: str, seed: int = 0) -> None:
    """A seeded random HF Llama in ``folder`` with a byte tokenizer padded to its vocab."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    fields = {k: v for k, v in config.items() if k != "architectures"}
    hf = LlamaConfig(**fields, architectures=config["architectures"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf, dtype=getattr(torch, dtype)).eval()
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(folder, config["vocab_size"])


def save_tokenizer(folder: Path, vocab_size: int) -> None:
    """Byte-level BPE over the 256 bytes, then BOS/EOS, then ``<n>`` filler tokens up to
    ``vocab_size`` so every id a random model picks decodes to text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {ch: i + 3 for i, ch in enumerate(alphabet)}
    for i in range(len(vocab), vocab_size):
        vocab[f"<{i}>"] = i
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    hf.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    hf.save_pretrained(folder)


# -- the parts ------------------------------------------------------------------------------------
def part_env(args: argparse.Namespace) -> dict:
    import jax

    device = jax.devices()[0]
    kind = device.device_kind
    return {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "device_kind": kind,
        "peak_bandwidth": _peak(kind),
    }


def _peak(kind: str) -> float | None:
    for name, peak in sorted(PEAK_BANDWIDTH.items(), key=lambda kv: -len(kv[0])):
        if name in kind:
            return peak
    return None


def part_kernels(args: argparse.Namespace) -> dict:
    marker = "tpu" if args.backend == "tpu" else "gpu"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            marker,
            "-rA",
            "-o",
            "addopts=",
            "tests/pallas_kernels",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=max(5.0, min(args.part_timeout, _remaining(args) - 5)),
        env=_env(),
    )
    counts = {
        word: int(n)
        for n, word in re.findall(
            r"(\d+) (passed|failed|skipped|error|errors|deselected)",
            result.stdout.splitlines()[-1] if result.stdout else "",
        )
    }
    lines = [
        ln for ln in result.stdout.splitlines() if ln.startswith(("PASSED", "FAILED", "ERROR"))
    ]
    return {
        "returncode": result.returncode,
        "counts": counts,
        "tests": lines,
        "tail": (result.stdout + result.stderr)[-4000:],
    }


def _engine(folder: Path, **fields: Any) -> Any:
    from jax_llm_runtime.runtime.config import EngineConfig
    from jax_llm_runtime.runtime.loading.builder import build_engine

    base = dict(model_id=str(folder), max_num_seqs=4, max_model_len=512, kvcache_mem_mb=256)
    engine = build_engine(EngineConfig(**{**base, **fields}))
    engine.start()
    return engine


def _engine_loop(args: argparse.Namespace) -> str:
    """The engines' ``--layer-loop`` (``both`` is for the step part; engines take the scan)."""
    return "auto" if args.layer_loop == "both" else args.layer_loop


def _generate(engine: Any, prompts: list[list[int]], max_tokens: int, tag: str) -> list[dict]:
    """Greedy tokens (EOS ignored) per prompt, all submitted at once, with each one's times."""
    import asyncio

    from jax_llm_runtime.runtime.engine.request import SamplingParams

    async def one(i: int, ids: list[int]) -> dict:
        tokens: list[int] = []
        stamps: list[float] = []
        sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        async for delta in engine.generate(ids, sampling, f"{tag}-{i}"):
            tokens += delta.token_ids
            stamps += [time.perf_counter() - t0] * len(delta.token_ids)
        return {"tokens": tokens, "stamps": stamps}

    async def every() -> list[dict]:
        return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))

    return asyncio.run(every())


def part_greedy_tokens(args: argparse.Namespace) -> dict:
    """Greedy tokens of the float32 model on this process's default backend (one precision)."""
    import jax

    if args.precision:
        jax.config.update("jax_default_matmul_precision", args.precision)
    engine = _engine(
        args.folder, dtype="float32", matmul_dtype="model", layer_loop=_engine_loop(args)
    )
    try:
        return {
            "backend": jax.default_backend(),
            "kernels": dict(engine.kernel_choices),
            "tokens": [r["tokens"] for r in _generate(engine, PROMPTS, GREEDY_TOKENS, "greedy")],
        }
    finally:
        engine.shutdown()


def part_greedy(args: argparse.Namespace) -> dict:
    folder = args.work / "smollm2-shape-f32"
    _child(
        "make",
        args,
        extra=["--folder", str(folder), "--shape", args.shape_small, "--dtype", "float32"],
    )
    out: dict[str, Any] = {"model": f"{args.shape_small} shape, random float32 weights"}
    runs = {"cpu": ("cpu", None), "device_highest": (None, "highest")}
    if not args.quick:
        runs["device_default"] = (None, "")
    for name, (platform, precision) in runs.items():
        extra = ["--folder", str(folder), "--precision", precision or ""]
        out[name] = _child("greedy_tokens", args, extra=extra, platform=platform)
    cpu = out["cpu"].get("tokens")
    for name in ("device_highest", "device_default"):
        tokens = out.get(name, {}).get("tokens")
        if cpu and tokens:
            out[f"{name}_equal"] = tokens == cpu
            out[f"{name}_first_difference"] = [
                next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), None)
                for x, y in zip(tokens, cpu, strict=True)
            ]
    return out


def part_throughput(args: argparse.Namespace) -> dict:
    folder = args.work / "smollm2-shape-f32"
    _child(
        "make",
        args,
        extra=["--folder", str(folder), "--shape", args.shape_small, "--dtype", "float32"],
    )
    out = _child("throughput_run", args, extra=["--folder", str(folder)])
    out["model"] = f"{args.shape_small} shape, random weights served in bfloat16"
    return out


def part_throughput_run(args: argparse.Namespace) -> dict:
    """Single-stream decode speed through the engine (a child process)."""
    out: dict[str, Any] = {}
    for steps in (0,) if args.quick else (0, 8):
        engine = _engine(
            args.folder,
            dtype="bfloat16",
            max_num_seqs=1,
            decode_steps=steps,
            layer_loop=_engine_loop(args),
        )
        t0 = time.perf_counter()
        engine.compile_done.wait(args.part_timeout / 2)  # no compile beside the timed decode
        out[f"compile_wait_s(decode_steps={steps})"] = round(time.perf_counter() - t0, 1)
        out["kernels"] = dict(engine.kernel_choices)
        try:
            _generate(engine, [PROMPTS[0]], 16, "warm")
            run = _generate(engine, [PROMPTS[0]], THROUGHPUT_TOKENS, "tput")[0]
        finally:
            engine.shutdown()
        stamps = run["stamps"]
        decode_s = stamps[-1] - stamps[0]
        out[f"decode_steps={steps}"] = {
            "tokens": len(run["tokens"]),
            "first_token_ms": round(stamps[0] * 1e3, 2),
            "decode_tok_per_s": round((len(stamps) - 1) / decode_s, 1) if decode_s > 0 else None,
        }
    return out


def part_step(args: argparse.Namespace) -> dict:
    folder = args.work / "llama3-8b-shape-bf16"
    made = _child(
        "make",
        args,
        extra=["--folder", str(folder), "--shape", args.shape_large, "--dtype", "bfloat16"],
    )
    if "error" in made:
        return {"error": "making the model: " + made["error"], "tail": made.get("tail")}
    config = json.loads((folder / "config.json").read_text())
    out: dict[str, Any] = {
        "model": f"{args.shape_large} shape, {config['num_hidden_layers']} of its layers, random "
        "bfloat16 weights",
        "context": args.context,
        "traces": [],
    }
    kv_per_position = (
        config["num_hidden_layers"]
        * 2
        * config["num_key_value_heads"]
        * (config["hidden_size"] // config["num_attention_heads"])
        * 2
    )
    weight_bytes = _bytes_read_per_step(folder, config)
    for fmt, pallas, num_seqs, flags in _step_runs(args):  # one process each, most wanted first
        label = fmt + ("+pallas" if pallas else "") + ("+xla-flags" if flags else "")
        timeout = min(args.part_timeout, _remaining(args) - 10)
        if timeout < 30:
            out[label] = {"error": "skipped: the check's deadline"}
            continue
        stdout, error = _bench_step(args, folder, fmt, pallas, num_seqs, flags, timeout)
        rows: dict[int | str, dict] = {}
        for num, what, best, median in re.findall(
            r"decode\s+(\d+) seqs\s+(\S+): best\s+([\d.]+)\s+median\s+([\d.]+)", stdout
        ):
            n, key = int(num), _row_key(num, what)
            row = {"best_ms": float(best), "median_ms": float(median)}
            if fmt == "float":  # the bytes of a packed format's step are not counted here
                read = weight_bytes + n * args.context * kv_per_position
                row["bytes_read"] = read
                row["bandwidth_GBps"] = round(read / (float(best) / 1e3) / 1e9, 1)
                if args.peak:
                    row["mbu"] = round(read / (float(best) / 1e3) / args.peak, 3)
            rows[key] = row
        for num, what, seconds in re.findall(
            r"decode\s+(\d+) seqs\s+(\S+): first call\s+([\d.]+) s", stdout
        ):
            key = _row_key(num, what)
            if key in rows:  # the compile: how long the unrolled step takes to build
                rows[key]["first_call_s"] = float(seconds)
        out[label] = rows or {"error": error or stdout[-3000:]}
        out["traces"] += [
            {**json.loads(line[len("TRACE ") :]), "run": label}
            for line in stdout.splitlines()
            if line.startswith("TRACE ")
        ]
    return out


def _row_key(num: str, what: str) -> int | str:
    """A step row's key: the sequence count, with ``+unrolled`` for the unrolled loop's."""
    return f"{num}+unrolled" if "+unrolled" in what else int(num)


def _step_runs(args: argparse.Namespace) -> list[tuple[str, bool, str, str]]:
    """(format, Pallas kernels forced, batch sizes, extra XLA flags) of the step part's
    benchmark processes: the Pallas kernels first, then the reference for the ratio; with
    ``--step-xla-flags``, the bfloat16 pair again under those flags before the packed formats."""
    formats = args.step_formats.split(",")
    first = args.num_seqs.split(",")[0]
    runs = [("float", True, args.num_seqs, ""), ("float", False, args.num_seqs, "")]
    if args.step_xla_flags:
        runs += [(fmt, pallas, n, args.step_xla_flags) for fmt, pallas, n, _ in runs]
    for fmt in (f for f in formats if f != "float"):
        runs += [(fmt, True, first, ""), (fmt, False, first, "")]
    return [r for r in runs if r[0] in formats]


def _bench_step(
    args: argparse.Namespace,
    folder: Path,
    fmt: str,
    pallas: bool,
    num_seqs: str,
    flags: str,
    timeout: float,
) -> tuple[str, str]:
    """``tools/bench_decode_step.py`` in a process, ``flags`` appended to ``XLA_FLAGS``: (its
    stdout, an error or "")."""
    env = _env()
    if flags:
        env["XLA_FLAGS"] = " ".join(f for f in (env.get("XLA_FLAGS", ""), flags) if f)
    command = [
        sys.executable,
        str(REPO / "tools" / "bench_decode_step.py"),
        "--model-id",
        str(folder),
        "--formats",
        fmt,
        "--dtype",
        "bfloat16",
        "--num-seqs",
        num_seqs,
        "--context",
        str(args.context),
        "--rounds",
        "5",
        "--native",
        "off",
        "--unroll-layers",
        {"auto": "auto", "scan": "off", "unrolled": "on", "both": "both"}[args.layer_loop],
        "--trace",
        str(args.work / "traces"),
        *(["--pallas"] if pallas else []),
    ]
    try:
        result = subprocess.run(
            command, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env
        )
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return stdout, f"timed out after {timeout:.0f} s"
    error = "" if result.returncode == 0 else (result.stdout + result.stderr)[-3000:]
    return result.stdout, error


def _remaining(args: argparse.Namespace) -> float:
    """Seconds left of ``--deadline`` (counted from the check's start)."""
    return args.deadline - (time.monotonic() - args.started)


def part_attention(args: argparse.Namespace) -> dict:
    """The paged-attention kernel against the reference alone, timed the way the startup
    selection times them (``selection.time_implementations``), on decodes of Llama-3-8B's heads
    in bfloat16 at ``--num-seqs`` sequences of ``--context`` positions; with the bandwidth of
    the K/V bytes read."""
    from types import SimpleNamespace

    import jax.numpy as jnp

    from jax_llm_runtime.pallas_kernels import selection

    cfg = TINY if args.tiny else LLAMA3_8B
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dim = cfg["hidden_size"] // heads
    attention = SimpleNamespace(
        num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, sliding_window=None, soft_cap=None
    )
    out: dict[str, Any] = {"heads": f"{heads} over {kv_heads} KV heads of {dim}, bfloat16"}
    for n in (int(n) for n in args.num_seqs.split(",")):
        run, call_args = selection.attention_speed_case(attention, jnp.bfloat16, n, args.context)
        kernel_ms, reference_ms = selection.time_implementations(run, call_args)
        kv_bytes = 2 * n * args.context * kv_heads * dim * 2
        out[n] = {
            "pallas_ms": round(kernel_ms, 4),
            "reference_ms": round(reference_ms, 4),
            "pallas_GBps": round(kv_bytes / kernel_ms / 1e6, 1),
            "reference_GBps": round(kv_bytes / reference_ms / 1e6, 1),
        }
    return out


def part_roofline(args: argparse.Namespace) -> dict:
    """What XLA's plain dots reach on this device for the step part's weights (its layers'
    projections and the LM head, bfloat16, no attention, norms or sampling): the ceiling the
    step's bandwidth is compared with."""
    import jax
    import jax.numpy as jnp

    cfg = dict(TINY if args.tiny else LLAMA3_8B)
    layers = min(args.layers, cfg["num_hidden_layers"])
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * d // cfg["num_attention_heads"]
    key = jax.random.PRNGKey(0)
    shapes = [(d, d + 2 * kv), (d, d), (d, 2 * f), (f, d)] * layers + [(d, v)]
    weights = [
        (jax.random.normal(jax.random.fold_in(key, i), s, jnp.float32) * 0.02).astype(jnp.bfloat16)
        for i, s in enumerate(shapes)
    ]

    @jax.jit
    def step(x, ws):
        for i in range(layers):
            wqkv, wo, wgu, wd = ws[4 * i : 4 * i + 4]
            x = x + (x @ wqkv)[:, :d] @ wo
            h = x @ wgu
            x = x + (jax.nn.silu(h[:, :f]) * h[:, f:]) @ wd
        return x @ ws[-1]

    total = sum(w.size * 2 for w in weights)
    out: dict[str, Any] = {"bytes": total, "layers": layers}
    for n in [int(n) for n in args.num_seqs.split(",")]:
        x = jnp.ones((n, d), jnp.bfloat16) * 0.01
        jax.block_until_ready(step(x, weights))
        best = float("inf")
        for _ in range(20):
            t0 = time.perf_counter()
            jax.block_until_ready(step(x, weights))
            best = min(best, time.perf_counter() - t0)
        out[n] = {"best_ms": round(best * 1e3, 3), "bandwidth_GBps": round(total / best / 1e9, 1)}
        if args.peak:
            out[n]["mbu"] = round(total / best / args.peak, 3)
    return out


def _bytes_read_per_step(folder: Path, config: dict) -> int:
    """Every weight's bytes except the embedding table's (a step reads one row of it per token)."""
    from safetensors import safe_open

    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(path, "np") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name.endswith("embed_tokens.weight") and not config.get("tie_word_embeddings"):
                    continue
                info = f.get_slice(name)
                n = 1
                for d in info.get_shape():
                    n *= d
                total += n * 2 if info.get_dtype() in ("BF16", "F16") else n * 4
    return total


# -- plumbing -------------------------------------------------------------------------------------
def _import_root() -> str | None:
    """A folder from which ``import jax_llm_runtime`` finds this repository: none is needed where
    the package is installed; else a link named so, made beside the check's work files."""
    import importlib.util

    if importlib.util.find_spec("jax_llm_runtime") is not None:
        return None
    root = Path("/tmp/accelerator-check-import")
    link = root / "jax_llm_runtime"
    root.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(REPO, target_is_directory=True)
    return str(root)


def _env(platform: str | None = None) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_import_root(), env.get("PYTHONPATH")) if p)
    if platform:
        env["JAX_PLATFORMS"] = platform
    return env


def _child(
    part: str,
    args: argparse.Namespace,
    extra: list[str] = (),  # type: ignore[assignment]
    platform: str | None = None,
) -> dict:
    """Run one part in a fresh process and return its JSON (or what went wrong)."""
    command = [
        sys.executable,
        __file__,
        "--part",
        part,
        "--work",
        str(args.work),
        "--part-timeout",
        str(args.part_timeout),
        "--layers",
        str(args.layers),
        "--num-seqs",
        args.num_seqs,
        "--context",
        str(args.context),
        "--layer-loop",
        args.layer_loop,
        *extra,
    ]
    command += ["--tiny"] * args.tiny + ["--quick"] * args.quick
    timeout = max(5.0, min(args.part_timeout, _remaining(args) - 5))
    t0 = time.perf_counter()
    try:
        result = subprocess.run(
            command,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=_env(platform),
        )
    except subprocess.TimeoutExpired as exc:
        tail = "".join(_text(x) for x in (exc.stdout, exc.stderr)).replace("\r", "\n")
        return {"error": f"timed out after {timeout:.0f} s", "tail": tail[-6000:]}
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        return {
            "error": f"exit {result.returncode}",
            "tail": (result.stdout + result.stderr)[-3000:],
        }
    out = json.loads(lines[-1][len("RESULT ") :])
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def _text(output: str | bytes | None) -> str:
    """A killed child's captured output (bytes, whatever ``text=True`` asked) as text."""
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


def _attention_lines(attn: dict) -> list[str]:
    return [
        f"- Paged attention alone ({attn.get('heads')}), {n} sequences: Pallas "
        f"{row['pallas_ms']} ms ({row['pallas_GBps']} GB/s), reference {row['reference_ms']} ms "
        f"({row['reference_GBps']} GB/s)"
        for n, row in attn.items()
        if str(n).isdigit()
    ]


def _markdown(results: dict) -> str:
    env = results.get("env", {})
    lines = [f"Device: {env.get('device_kind')} ({env.get('backend')}), JAX {env.get('jax')}", ""]
    kernels = results.get("kernels", {})
    lines += [f"- Kernel tests on the device: {kernels.get('counts', kernels.get('error'))}"]
    greedy = results.get("greedy", {})
    lines += [
        f"- Greedy tokens, device (highest precision) == CPU: {greedy.get('device_highest_equal')};"
        f" at the default precision: {greedy.get('device_default_equal')}"
        f" (first differences {greedy.get('device_default_first_difference')})"
    ]
    for part in ("greedy", "throughput"):
        chosen = results.get(part, {}).get("kernels") or results.get(part, {}).get(
            "device_highest", {}
        ).get("kernels")
        if chosen:
            lines.append(f"- Kernels the engine chose ({part}): {chosen}")
    tput = results.get("throughput", {})
    for key, row in tput.items():
        if key.startswith("decode_steps") and isinstance(row, dict):
            lines.append(
                f"- {tput.get('model')}, single stream, {key}: {row.get('decode_tok_per_s')} tok/s"
            )
    lines += _attention_lines(results.get("attention", {}))
    roof = results.get("roofline", {})
    for n in (k for k in roof if str(k).isdigit()):
        row = roof[n]
        lines.append(
            f"- XLA's plain dots over the step's weights, {n} rows: {row['best_ms']} ms, "
            f"{row['bandwidth_GBps']} GB/s, MBU {row.get('mbu')}"
        )
    step = results.get("step", {})
    if step:
        lines += [
            "",
            f"{step.get('model')}, {step.get('context')} positions per sequence:",
            "",
            "| format | sequences | best ms | median ms | GB/s | MBU | first call s |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for fmt, rows in step.items():
            if isinstance(rows, dict) and all(str(k).split("+")[0].isdigit() for k in rows):
                for n, row in rows.items():
                    lines.append(
                        f"| {fmt} | {n} | {row['best_ms']} | {row['median_ms']} | "
                        f"{row.get('bandwidth_GBps', '')} | {row.get('mbu', '')} | "
                        f"{row.get('first_call_s', '')} |"
                    )
            elif isinstance(rows, dict) and "error" in rows:
                lines.append(f"| {fmt} | error: {rows['error'][:200]!r} | | | | | |")
    for trace in step.get("traces", []):
        lines += [
            "",
            f"Device time of `{trace['step']}` ({trace.get('run')}): {trace['total_us']} us a call",
            "",
        ]
        lines += [
            f"- {us} us ({share:.0%}, {n}x) {name[:100]}"
            for name, us, n, share in trace["kernels"][:8]
        ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("accelerator-check"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/accelerator-check"))
    parser.add_argument("--parts", default="env,kernels,attention,roofline,step,greedy,throughput")
    parser.add_argument("--layers", type=int, default=8, help="of Llama-3-8B's 32 (step part)")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--num-seqs", default="1,64")
    parser.add_argument("--step-formats", default="float,q4_0")
    parser.add_argument(
        "--step-xla-flags",
        default="",
        help="XLA flags for a second pair of bfloat16 step runs (labelled +xla-flags), e.g. "
        "--xla_gpu_enable_dynamic_slice_fusion=true",
    )
    parser.add_argument("--part-timeout", type=int, default=240)
    parser.add_argument(
        "--layer-loop",
        choices=("auto", "scan", "unrolled", "both"),
        default="auto",
        help="the engines' --layer-loop and the step part's (both: the step part times each)",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=3600,
        help="seconds for the whole check: a part that would start with under 30 s left is "
        "skipped, and each process's timeout is cut to what is left",
    )
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: test the tool on a CPU")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer runs: greedy tokens at the highest precision only, throughput with the "
        "default --decode-steps only",
    )
    # Internal: one part in a child process.
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="", help=argparse.SUPPRESS)
    parser.add_argument("--peak", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.started = time.monotonic()
    shapes = {"smollm2-135m": SMOLLM2, "llama-3-8b": LLAMA3_8B, "tiny": TINY}
    args.shape_small = "tiny" if args.tiny else "smollm2-135m"
    args.shape_large = "tiny" if args.tiny else "llama-3-8b"
    args.work.mkdir(parents=True, exist_ok=True)

    if args.part:  # a child
        if args.part == "make":
            config = dict(shapes[args.shape])
            if args.layers and args.shape != "smollm2-135m":
                config["num_hidden_layers"] = min(args.layers, config["num_hidden_layers"])
            if not (args.folder / "config.json").exists():
                make_model(args.folder, config, args.dtype)
            result: dict = {"folder": str(args.folder)}
        else:
            result = globals()[f"part_{args.part}"](args)
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    results: dict[str, Any] = {}
    args.out.mkdir(parents=True, exist_ok=True)
    env = _child("env", args)
    results["env"] = env
    args.backend = env.get("backend")
    args.peak = env.get("peak_bandwidth")
    print(json.dumps(env), flush=True)
    for part in args.parts.split(","):
        if part == "env":
            continue
        if _remaining(args) < 30:
            results[part] = {"error": "skipped: the check's deadline"}
            continue
        if part in ("roofline", "attention"):  # runs JAX: a child of its own
            extra = ["--peak", str(args.peak)] if args.peak else []
            results[part] = _child(part, args, extra=extra)
            print(part, json.dumps(results[part]), flush=True)
            continue
        t0 = time.perf_counter()
        try:
            results[part] = globals()[f"part_{part}"](args)
        except Exception as exc:  # one part's failure is a figure too
            results[part] = {"error": f"{type(exc).__name__}: {exc}"}
        results[part].setdefault("seconds", round(time.perf_counter() - t0, 1))
        print(part, json.dumps(results[part])[:2000], flush=True)
        (args.out / "accelerator_check.json").write_text(json.dumps(results, indent=1))
    table = _markdown(results)
    (args.out / "accelerator_check.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
