"""The torch target's growing K/V layer: the same contents as transformers' DynamicLayer under appends, crops and
assignments, with copies that amortise (a decode step writes in place; the buffer is reallocated log2(n) times)."""

import math

import pytest

torch = pytest.importorskip("torch")
from transformers.cache_utils import DynamicLayer

from dflash.backends.torch.kv_cache import GrowingLayer, WindowedStaticLayer, attention_window, growing


def kv(t, seed, rows=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 2, t, 4, generator=g), torch.randn(rows, 2, t, 4, generator=g)


def test_appends_and_crops_match_dynamic_layer():
    ours, theirs = GrowingLayer(), DynamicLayer()
    for step in range(300):
        t = 16 if step % 3 == 0 else 1  # verify blocks and single tokens
        k, v = kv(t, step)
        a, b = ours.update(k, v), theirs.update(k, v)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        if t == 16:  # a verify keeps a prefix of its block
            ours.crop(-(step % 15))
            theirs.crop(-(step % 15))
        assert ours.get_seq_length() == theirs.get_seq_length()
    assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
    # every reallocation copies the cache once: they come at doubling lengths, not once per step
    assert ours.growths <= math.ceil(math.log2(ours.get_seq_length())) + 1


def test_limit_caps_the_buffer():
    layer = GrowingLayer(limit=40)
    for step in range(40):
        layer.update(*kv(1, step))
    assert layer.capacity == 40 and layer.growths == 7  # 1, 2, 4, 8, 16, 32, 40
    layer.update(*kv(3, 99))  # past the limit when a forward needs it
    assert layer.get_seq_length() == 43


def test_assigned_tensors_are_adopted_and_never_written():
    layer = GrowingLayer()
    layer.update(*kv(10, 0))
    k, v = kv(12, 1, rows=2)  # a merge assigns keys, then values, of a new length
    layer.keys = k
    assert layer.values.shape[2] == 10  # values keep their own length until they are assigned
    layer.values = v
    kept_k, kept_v = k.clone(), v.clone()
    layer.crop(-4)
    new = kv(2, 2, rows=2)
    keys, values = layer.update(*new)
    assert torch.equal(k, kept_k) and torch.equal(v, kept_v)  # the adopted tensors were copied, not written
    assert torch.equal(keys, torch.cat([kept_k[:, :, :8], new[0]], dim=2))
    assert torch.equal(values, torch.cat([kept_v[:, :, :8], new[1]], dim=2))


def test_growing_replaces_plain_layers_only():
    class Other(DynamicLayer):
        pass

    class Cache:
        layers = [DynamicLayer(), Other()]
        layer_class_to_replicate = None

    cache = growing(Cache(), 64)
    assert isinstance(cache.layers[0], GrowingLayer) and type(cache.layers[1]) is Other


def test_attention_window_is_a_power_of_two_bucket_within_the_buffer():
    assert [attention_window(n, 2048) for n in (1, 256, 257, 600, 1025, 2048)] == [256, 256, 512, 1024, 2048, 2048]
    assert attention_window(300, 400) == 400  # never past the buffer


def test_windowed_static_layer_attends_over_its_window_only():
    """A forward sees the first `window` positions (what it wrote included) and the mask is sized to match."""
    layer = WindowedStaticLayer(max_cache_len=1024)
    k, v = kv(300, 0)
    layer.update(k, v)  # a prefill of 300 positions
    layer.window = 512
    k1, v1 = kv(1, 1)
    keys, values = layer.update(k1, v1)
    assert keys.shape[-2] == values.shape[-2] == 512 and layer.get_mask_sizes(1) == (512, 0)
    assert torch.equal(keys[:, :, :300], k) and torch.equal(keys[:, :, 300:301], k1)
    assert torch.equal(values[:, :, 300:301], v1)
    assert int(layer.get_seq_length()) == 301


def filled(rows, t, seed):
    layer = GrowingLayer()
    layer.update(*kv(t, seed, rows=rows))
    return layer


def test_a_join_pads_with_zeros_and_keeps_both_sides_entries():
    batch, row = filled(2, 5, 0), filled(1, 8, 1)
    mine_k, theirs_k = batch.keys.clone(), row.keys.clone()
    batch.join(row, 3, 0)  # the joining row is longer: the batch's rows move right by 3
    assert batch.keys.shape == (3, 2, 8, 4) and batch.values.shape == (3, 2, 8, 4)
    assert (batch.keys[:2, :, :3] == 0).all() and (batch.values[:2, :, :3] == 0).all()
    assert torch.equal(batch.keys[:2, :, 3:], mine_k) and torch.equal(batch.keys[2:], theirs_k)
    short = filled(1, 2, 2)
    batch.join(short, 0, 6)
    assert (batch.keys[3, :, :6] == 0).all() and torch.equal(batch.keys[3, :, 6:], short.keys[0])


def test_rows_join_into_spare_rows_and_leave_from_the_end_without_copies():
    batch = filled(1, 6, 0)
    for seed in range(1, 4):
        batch.join(filled(1, 6, seed), 0, 0)
    assert batch.row_capacity == 4 and batch.growths == 3  # 1 -> 2 -> 4 rows: reallocated twice after the prefill
    batch.update(*kv(1, 5, rows=4))  # (room for more positions: 6 -> 12)
    address, growths = batch._k.data_ptr(), batch.growths
    third = batch.keys[2].clone()
    batch.take_rows([0, 1, 2])  # the last row leaves: nothing moves
    assert batch.rows == 3 and batch._k.data_ptr() == address and batch.growths == growths
    batch.take_rows([0, 2])  # a middle row leaves: the rows after it move up, in place
    assert torch.equal(batch.keys[1], third) and batch._k.data_ptr() == address
    batch.join(filled(1, 7, 9), 0, 0)  # a joining row fills a spare row of the same buffers
    batch.update(*kv(1, 10, rows=3))  # and the next forward writes all rows in place
    assert batch._k.data_ptr() == address and batch.growths == growths and batch.keys.shape == (3, 2, 8, 4)


def test_a_gather_keeps_each_rows_slots_in_order():
    layer = filled(2, 6, 0)
    before = layer.keys.clone()
    index = torch.tensor([[0, 2, 5], [1, 3, 4]])
    layer.gather_slots(index)
    assert layer.length == 3
    for i in range(2):
        assert torch.equal(layer.keys[i], before[i][:, index[i]])
