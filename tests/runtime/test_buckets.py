import pytest

from jax_llm_runtime.runtime.engine.buckets import BucketPlan, pick


@pytest.mark.parametrize(
    "max_num_seqs,max_model_len,chunk",
    [(8, 512, 8192), (5, 1000, 300), (1, 64, 64), (64, 256, 128)],
)
def test_every_schedulable_step_has_a_compiled_shape(max_num_seqs, max_model_len, chunk):
    """(num_tokens, num_seqs, pages) of a lone chunk, a decode step and a mixed step."""
    plan = BucketPlan.build(max_num_seqs, max_model_len, chunk, page_size=16)
    shapes = set(plan.shapes())
    pages = lambda n: pick(plan.pages, -(-n // 16))  # noqa: E731
    for start in range(0, max_model_len, 7):
        for length in range(1, min(plan.max_chunk, max_model_len - start) + 1, 5):
            assert (pick(plan.prefill_lens, length), 1, pages(start + length)) in shapes
    for n in range(1, max_num_seqs + 1 if max_num_seqs > 1 else 1):
        for kv_end in range(1, max_model_len + 1, 11):
            assert (pick(plan.decode_seqs, n), pick(plan.decode_seqs, n), pages(kv_end)) in shapes
            for tokens in range(n + 1, plan.prefill_lens[-1] + 1, 13):
                mixed = (pick(plan.mixed_lens, tokens), plan.mixed_seqs, pages(kv_end))
                assert mixed in shapes and mixed[0] > mixed[1]
    assert plan.prefill_lens[-1] >= plan.max_chunk + max_num_seqs or max_num_seqs == 1


def test_pick_rejects_oversized():
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        pick((1, 2, 4), 5)


def test_prefill_chunks_fill_a_bucket_and_only_the_last_pads():
    from jax_llm_runtime.runtime.engine.buckets import fit_tokens

    def fit_chunk(lens: tuple[int, ...], pending: int, chunk_size: int) -> int:
        return fit_tokens(lens, 0, min(pending, chunk_size))

    lens = BucketPlan.build(8, 8192, 8192, page_size=16).prefill_lens
    assert lens[:4] == (32, 64, 128, 256)
    for prompt in (1, 31, 32, 33, 156, 500, 1000, 8192):
        pending, chunks = prompt, []
        while pending:
            chunks.append(fit_chunk(lens, pending, 8192))
            pending -= chunks[-1]
        assert sum(chunks) == prompt
        assert all(c in lens for c in chunks[:-1])
        padded = sum(pick(lens, c) for c in chunks)
        assert padded - prompt < max(lens[0], prompt / 8), (prompt, chunks)
    assert fit_chunk(lens, 156, 8192) == 128  # 256 would pad 100 tokens
    assert fit_chunk(lens, 500, 8192) == 500  # one step padded by 12 beats five steps
    assert fit_chunk(lens, 100, 48) == 32  # the chunk size caps first
