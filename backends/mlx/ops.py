"""The array namespace dflash.core.rules runs on, over mx.arrays."""

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
