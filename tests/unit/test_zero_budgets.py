"""Note [buckets bounded by the model]: DeepSpeed's bucket sizes are upper bounds, capped at 1/8 of
the trainable elements (never below 2**20)."""

from zerospeed.zero.budgets import MIN_BUCKET, bounded_budgets, model_bound


def test_model_bound_is_an_eighth_of_the_model_rounded_up_with_a_floor():
    assert model_bound(124_439_808) == 15_554_976  # GPT-2 small: 124,439,808 / 8
    assert model_bound(124_439_809) == 15_554_977  # rounded up
    assert model_bound(5_000) == MIN_BUCKET == 1_048_576
    assert model_bound(8 * MIN_BUCKET) == MIN_BUCKET


def test_configured_sizes_below_the_bound_are_kept_and_larger_ones_capped():
    gpt2 = bounded_budgets(
        124_439_808, reduce_bucket_size=500_000_000, prefetch_bucket_size=50_000_000, max_reuse_distance=1_000_000_000
    )  # DeepSpeed's defaults
    assert (gpt2.reduce_bucket, gpt2.prefetch_bucket, gpt2.reuse_distance) == (15_554_976,) * 3
    small = bounded_budgets(124_439_808, reduce_bucket_size=5_000_000, prefetch_bucket_size=0, max_reuse_distance=0)
    assert (small.reduce_bucket, small.prefetch_bucket, small.reuse_distance) == (5_000_000, 0, 0)


def test_stage3_gather_window_never_below_the_floor():
    """Note [stage-3 gather window floor]: below 2**23 elements the window is not cut (a 4.2M GPT keeps its
    units between forward and backward); a large model is bounded by 1/8 as before; the reduce bucket is not
    affected; an explicitly smaller setting is honoured."""
    from zerospeed.zero.budgets import MIN_GATHER_WINDOW

    assert MIN_GATHER_WINDOW == 8_388_608
    tiny = bounded_budgets(
        4_240_896, reduce_bucket_size=500_000_000, prefetch_bucket_size=50_000_000, max_reuse_distance=1_000_000_000
    )
    assert (tiny.reduce_bucket, tiny.prefetch_bucket, tiny.reuse_distance) == (MIN_BUCKET, 8_388_608, 8_388_608)
    gpt2 = bounded_budgets(
        124_439_808, reduce_bucket_size=500_000_000, prefetch_bucket_size=50_000_000, max_reuse_distance=1_000_000_000
    )
    assert gpt2.prefetch_bucket == gpt2.reuse_distance == 15_554_976  # 1/8 of the model, above the floor
    off = bounded_budgets(4_240_896, reduce_bucket_size=500_000_000, prefetch_bucket_size=0, max_reuse_distance=0)
    assert (off.prefetch_bucket, off.reuse_distance) == (0, 0)
