import pytest

from jax_llm_runtime.runtime.engine.buckets import BucketPlan, pick


@pytest.mark.parametrize(
    "max_num_seqs,max_model_len,chunk", [(8, 512, 8192), (5, 1000, 300), (1, 64, 64)]
)
def test_every_schedulable_step_has_a_compiled_shape(max_num_seqs, max_model_len, chunk):
    plan = BucketPlan.build(max_num_seqs, max_model_len, chunk, page_size=16)
    shapes = set(plan.shapes())
    pages = lambda n: pick(plan.pages, -(-n // 16))  # noqa: E731
    for start in range(0, max_model_len, 7):
        for length in range(1, min(chunk, max_model_len - start) + 1, 5):
            assert (1, pick(plan.prefill_lens, length), pages(start + length)) in shapes
    for n in range(1, max_num_seqs + 1):
        for kv_end in range(1, max_model_len + 1, 11):
            assert (pick(plan.decode_seqs, n), 1, pages(kv_end)) in shapes


def test_pick_rejects_oversized():
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        pick((1, 2, 4), 5)


def test_prefill_chunks_fill_a_bucket_and_only_the_last_pads():
    from jax_llm_runtime.runtime.engine.buckets import fit_chunk

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
