"""The array namespace dflash.core.rules and dflash.core.proposals run on, over mx.arrays."""

from __future__ import annotations

import mlx.core as mx


class MLXOps:
    @staticmethod
    def sum(x, axis, keepdims=False):
        return mx.sum(x, axis=axis, keepdims=keepdims)

    @staticmethod
    def cumsum(x, axis):
        return mx.cumsum(x, axis=axis)

    where, maximum, minimum, tanh = (staticmethod(f) for f in (mx.where, mx.maximum, mx.minimum, mx.tanh))

    @staticmethod
    def gather(x, ids, axis):
        return mx.take_along_axis(x, ids, axis=axis)

    @staticmethod
    def scatter(like, ids, values, axis):
        return mx.put_along_axis(mx.zeros_like(like), ids, values.astype(like.dtype), axis=axis)

    @staticmethod
    def concatenate(parts, axis):
        return mx.concatenate(parts, axis=axis)

    @staticmethod
    def token_ids(x):
        return x.astype(mx.int32)

    @staticmethod
    def argmax(x, axis):
        return mx.argmax(x, axis=axis).astype(mx.int32)

    @staticmethod
    def softmax(x, axis):
        return mx.softmax(x.astype(mx.float32), axis=axis)

    @staticmethod
    def top_k(x, k):
        """A partition, then a sort of k (a full argsort of the vocabulary costs more than a draft on a CPU)."""
        ids = mx.argpartition(-x, kth=k - 1, axis=-1)[..., :k]
        top = mx.take_along_axis(x, ids, axis=-1)
        order = mx.argsort(-top, axis=-1)
        return mx.take_along_axis(top, order, axis=-1), mx.take_along_axis(ids, order, axis=-1).astype(mx.int32)

    @staticmethod
    def stack(parts, axis=0):
        return mx.stack(parts, axis=axis)

    broadcast_to, zeros_like = staticmethod(mx.broadcast_to), staticmethod(mx.zeros_like)

    @staticmethod
    def from_host(values, like):
        return mx.array(values, dtype=mx.float32)
