import pytest

from runtime.buckets import BucketPlan, pick


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
