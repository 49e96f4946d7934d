"""dflash.core.prefix_cache: finished rows' caches kept in bytes-bounded LRU order and taken by prompts sharing their
prefix; a row rebuilt from a kept prefix decodes exactly like a fresh batch-1 prefill."""

import pytest

from dflash.core.prefix_cache import PrefixCache


def test_lru_bound_longest_match_and_single_use():
    cache = PrefixCache(max_bytes=100, min_tokens=2)
    cache.put([1, 2, 3, 4], "a", 40)
    cache.put([1, 2, 9, 9, 9], "b", 40)
    assert cache.take([1, 2, 3, 4, 5, 6]) == "a"  # the longest shared prefix wins
    assert cache.take([1, 2, 3, 4, 5, 6]) == "b"  # "a" was used; "b" still shares 2 tokens
    assert cache.take([1, 2, 3]) is None and cache.bytes == 0
    for k in range(4):
        cache.put([k, k, k], k, 40)
    assert len(cache) == 2 and cache.bytes == 80 and cache.take([0, 0, 0, 1]) is None  # oldest evicted
    cache.put([7, 7], "short", 10)
    cache.put([7, 7, 7, 7], "long", 10)  # supersedes its own prefix
    assert cache.take([7, 7, 7, 7, 7]) == "long" and cache.take([7, 7, 7]) is None
    cache.put([5] * 10, "huge", 1000)
    assert cache.take([5] * 11) is None  # over the whole budget: never kept
    assert cache.take([3, 3, 3, 1], at_least=3) is None  # must beat what the caller already has


@pytest.fixture(params=["torch", "mlx"])
def load(request, trained_pair):
    """() -> a fresh engine over the trained pair on each backend that batches."""
    if request.param == "mlx":
        pytest.importorskip("mlx_lm")
    from dflash import backends

    return lambda: backends.get(request.param).load(*trained_pair, dtype="float32", device="cpu")


def test_second_turn_from_a_kept_row_equals_a_fresh_prefill(load, prompts):
    from dflash.core.loop import Batch, Generation, generate

    be = load()
    be.enable_prefix_cache(64 << 20)
    batch = Batch(be)
    first = Generation(be, prompts[0], max_new_tokens=20)
    other = Generation(be, prompts[1], max_new_tokens=120)
    batch.join(other)
    batch.join(first)
    while first.result is None:
        batch.step()
    assert len(be.prefix_cache) == 1  # the finished row was kept while `other` runs on
    turn2 = prompts[0] + first.result.tokens + prompts[2][:6]
    second = Generation(be, turn2, max_new_tokens=40)
    batch.join(second)
    assert be.last_reused >= len(prompts[0])
    while batch:
        batch.step()
    solo = load()
    assert second.result.tokens == generate(solo, turn2, max_new_tokens=40).tokens
    assert other.result.tokens == generate(solo, prompts[1], max_new_tokens=120).tokens
    # alone again: the kept rows beat the engine's own last sequence
    third = Generation(be, turn2 + second.result.tokens + [5, 6, 7], max_new_tokens=16)
    batch.join(third)
    assert be.last_reused >= len(turn2)
    while batch:
        batch.step()
    assert third.result.tokens == generate(solo, third.prompt_ids, max_new_tokens=16).tokens
