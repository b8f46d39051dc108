"""The on-device sampler's time per step, against a sort-based formulation of the same filters.

``runtime.engine.sampler.sample`` finds the top-k / top-p / min-p cut and the draw by bisection over
the row's weights; the peer sorts each row of logits
(``argsort``) and filters the sorted prefix, which is how the sampler worked before. Both run
jitted on the default backend in the same process, interleaved round by round, on random
logits of the real vocabulary size (``--logits random``: so flat that a top_p nucleus holds
thousands of tokens), or on the logits the packaged SmolLM2-135M-Instruct gives while it writes
a story (``--logits smollm2``: HF transformers on the CPU, reading the GGUF), whose nuclei the
tool prints.

    .venv/bin/python tools/bench_sampler.py --rows 1,16 --logits smollm2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_llm_runtime.runtime.engine.sampler import empty_sampling_metadata, sample

SETTINGS = {
    "greedy": {"temperature": 0.0},
    "temperature 0.8": {"temperature": 0.8},
    "top_p 0.95": {"temperature": 0.8, "top_p": 0.95},
    "temperature 1, top_p 0.95": {"temperature": 1.0, "top_p": 0.95},
    "top_k 40, min_p 0.05": {"temperature": 0.8, "top_k": 40, "min_p": 0.05},
}


def sorted_sample(logits: jax.Array, meta) -> jax.Array:
    """The peer: temperature, then top-k / top-p / min-p on the sorted row, then a draw; the sort
    is skipped when every row is greedy."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    drawn = jax.lax.cond(
        jnp.all(meta.temperature == 0.0), lambda: greedy, lambda: _sorted_draw(logits, meta)
    )
    return jnp.where(meta.temperature == 0.0, greedy, drawn)


def _sorted_draw(logits: jax.Array, meta) -> jax.Array:
    vocab = logits.shape[-1]
    temperature = jnp.where(meta.temperature > 0.0, meta.temperature, 1.0)
    scaled = logits / temperature[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    ranked = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    keep = rank < jnp.where(meta.top_k > 0, meta.top_k, vocab)[:, None]
    probs = jax.nn.softmax(jnp.where(keep, ranked, -jnp.inf), axis=-1)
    keep &= jnp.cumsum(probs, axis=-1) - probs < meta.top_p[:, None]
    keep &= ranked >= ranked[:, :1] + jnp.log(meta.min_p)[:, None]
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(
        meta.seeds, meta.output_index
    )
    choice = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, ranked, -jnp.inf))
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def _story_logits(tokens: int = 300) -> np.ndarray:
    """[tokens, vocab] next-token logits of SmolLM2-135M-Instruct (the packaged Q4_1 GGUF, run by
    HF transformers) along a story it samples at temperature 1."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jax_llm_runtime.runtime.loading.sources import resolve_model_source

    path = resolve_model_source("smollm2-135m-instruct").path
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    prompt = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
    ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False)
    ids = torch.tensor([ids])
    torch.manual_seed(0)
    out = model.generate(ids, max_new_tokens=tokens, do_sample=True, temperature=1.0, top_p=1.0)
    with torch.no_grad():
        return model(out).logits[0, ids.shape[1] - 1 : -1].float().numpy()


def _print_nuclei(logits: np.ndarray) -> None:
    """How many tokens the top_p nucleus of each row holds, by temperature."""
    for temperature in (0.7, 1.0):
        for top_p in (0.9, 0.95):
            z = logits / temperature
            p = np.exp(z - z.max(-1, keepdims=True))
            p = -np.sort(-p / p.sum(-1, keepdims=True), -1)
            size = (np.cumsum(p, -1) < top_p).sum(-1) + 1
            print(
                f"nucleus at temperature {temperature}, top_p {top_p}: median "
                f"{np.median(size):.0f}, p99 {np.percentile(size, 99):.0f}, max {size.max()}, "
                f"wider than 64: {np.mean(size > 64):.1%}, than 1024: {np.mean(size > 1024):.1%}"
            )


def _time(fn, args, calls: int) -> float:
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--logits", choices=("random", "smollm2"), default="random")
    args = parser.parse_args()
    story = _story_logits() if args.logits == "smollm2" else None
    if story is not None:
        args.vocab = story.shape[1]
        _print_nuclei(story)
    ours = jax.jit(lambda logits, meta: sample(logits, meta).token_ids)
    peer = jax.jit(sorted_sample)
    print(f"sampler ms per step, vocabulary {args.vocab} ({jax.default_backend()})")
    print(f"{'rows':>4}  {'setting':<22} {'ours':>8} {'sort':>8} {'sort/ours':>10}")
    for rows in (int(r) for r in args.rows.split(",")):
        if story is None:
            sample_rows = np.random.default_rng(0).standard_normal((rows, args.vocab)) * 3
        else:  # every 7th position: consecutive ones are alike
            sample_rows = story[np.arange(rows) * 7 % len(story)]
        logits = jnp.asarray(sample_rows, jnp.float32)
        for label, setting in SETTINGS.items():
            meta = empty_sampling_metadata(rows)
            meta.seeds[:] = np.arange(rows)
            for field, value in setting.items():
                getattr(meta, field)[:] = value
            times: dict[str, list[float]] = {"ours": [], "sort": []}
            for _ in range(args.rounds):
                times["ours"].append(_time(ours, (logits, meta), 10))
                times["sort"].append(_time(peer, (logits, meta), 2 if rows > 4 else 5))
            a, b = statistics.median(times["ours"]), statistics.median(times["sort"])
            print(f"{rows:>4}  {label:<22} {a:8.2f} {b:8.2f} {b / a:9.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
