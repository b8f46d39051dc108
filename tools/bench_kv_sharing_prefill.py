"""A prompt's prefill on a Gemma 4 E2B-shaped model with random weights: the step narrowed to each
sequence's last row from the first KV-sharing layer on (what runtime-serve runs), against the
same step with every row through every layer, timed interleaved in one process.

Gemma 4 E2B's last 20 of 35 layers reuse earlier layers' K/V and write none, so in a prefill
only the row whose logits are read needs them (``models.decoder._last_rows_only``). The model
here keeps E2B's widths (hidden 1536, 8 heads of 256 over one KV head, full layers' heads of
512, per-layer inputs of 256, MLPs twice as wide in the sharing layers) with fewer layers and a
small vocabulary, so that it fits beside a test run; the sharing layers' share of the layers
(``--shared`` of ``--layers``) is E2B's. Prints the greatest logit difference of the two forms
and each form's best and median time.

    .venv/bin/python tools/bench_kv_sharing_prefill.py --layers 12 --shared 7 --prompt 512
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jax_llm_runtime.models import decoder
from jax_llm_runtime.models.batch import StepBatch
from jax_llm_runtime.pallas_kernels.paged_attention import KVCache
from tests.models.harness import load_ours

VOCAB, PAGE = 8192, 16


def _save_model(folder: Path, layers: int, shared: int) -> None:
    import torch
    import transformers

    types = ["full_attention" if i % 5 == 4 else "sliding_attention" for i in range(layers)]
    types[-1] = "full_attention"
    config = transformers.Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=1536, intermediate_size=3072, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=1, head_dim=256, global_head_dim=512,
        sliding_window=512, layer_types=types, hidden_size_per_layer_input=256,
        vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=shared, use_double_wide_mlp=True,
        max_position_embeddings=4096,
    )  # fmt: skip
    config.architectures = ["Gemma4ForCausalLM"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--shared", type=int, default=7)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        _save_model(Path(tmp), args.layers, args.shared)
        model = load_ours(Path(tmp))
    cfg, n = model.config, args.prompt
    pages = -(-n // PAGE)
    k_shape, v_shape = cfg.cache_shapes(pages + 1, PAGE)
    cache = KVCache(np.zeros(k_shape, np.float32), np.zeros(v_shape, np.float32))
    tokens = np.random.default_rng(0).integers(0, VOCAB, (1, n))
    page_indices = np.arange(pages, dtype=np.int32)[None]
    batch = StepBatch.padded(tokens, np.arange(n)[None], [n], [n], page_indices)
    narrowed = jax.jit(model.spec.forward, static_argnums=0)
    first = decoder.DecoderConfig.first_reusing_layer

    def every_row(cfg, weights, cache, batch):  # traced with narrowing off
        decoder.DecoderConfig.first_reusing_layer = property(lambda _: None)
        try:
            return model.spec.forward(cfg, weights, cache, batch)
        finally:
            decoder.DecoderConfig.first_reusing_layer = first

    forms = {"narrowed": narrowed, "every row": jax.jit(every_row, static_argnums=0)}
    logits = {name: np.asarray(f(cfg, model.weights, cache, batch)[0]) for name, f in forms.items()}
    print(
        f"{args.layers} layers, the last {args.shared} sharing K/V; a {n}-token prompt; "
        f"max |logit difference| {np.abs(logits['narrowed'] - logits['every row']).max():.2e}"
    )
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(args.rounds):
        for name, f in forms.items():
            start = time.perf_counter()
            jax.block_until_ready(f(cfg, model.weights, cache, batch))
            times[name].append(time.perf_counter() - start)
    for name, t in times.items():
        print(f"{name:>10}: best {min(t):.3f} s, median {statistics.median(t):.3f} s")


if __name__ == "__main__":
    main()
