"""The array namespace dflash.core.rules runs on, over mx.arrays."""

from __future__ import annotations

import math

import mlx.core as mx

_CHUNK = 64  # top_k: elements per chunk of the axis
_LOG2_E = 1 / math.log(2)


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
        """(values, ids) of the k largest along the last axis, largest first, without a partition of the whole axis: on
        MLX's CPU backend a partition of 15 x 4096 logits costs ~0.6 ms, more than a small draft's layers. The k largest
        lie in the k chunks of _CHUNK whose maxima are largest (any other chunk's elements are below k maxima), so the
        one partition runs over those chunks' k * _CHUNK elements, then only the k are sorted. Exact (ties aside)."""
        *lead, v = x.shape
        if k * _CHUNK >= v:
            ids = mx.argpartition(-x, kth=k - 1, axis=-1)[..., :k]
        else:
            padded = x if v % _CHUNK == 0 else mx.concatenate(  # (whole chunks: -inf, which no top-k takes)
                [x, mx.full((*lead, _CHUNK - v % _CHUNK), -mx.inf, dtype=x.dtype)], axis=-1)
            chunks = padded.reshape(*lead, -1, _CHUNK)
            best = mx.argpartition(-chunks.max(axis=-1), kth=k - 1, axis=-1)[..., :k]  # (..., k) chunk ids
            pool = mx.take_along_axis(chunks, best[..., None], axis=-2).reshape(*lead, k * _CHUNK)
            j = mx.argpartition(-pool, kth=k - 1, axis=-1)[..., :k]
            ids = mx.take_along_axis(best, j // _CHUNK, axis=-1) * _CHUNK + j % _CHUNK
        top = mx.take_along_axis(x, ids, axis=-1)
        order = mx.argsort(-top, axis=-1)
        return mx.take_along_axis(top, order, axis=-1), mx.take_along_axis(ids, order, axis=-1).astype(mx.int32)

    @staticmethod
    def top_probs(logits, k):
        """top_k(softmax(logits)) without a softmax over the vocabulary: the top k logits, over a normaliser that takes
        2^x (MLX's CPU backend computes exp at ~12 ns an element, 2^x ~2.5x faster). Probabilities within 1e-6."""
        x = logits.astype(mx.float32)
        top, ids = MLXOps.top_k(x, k)
        peak = top[..., :1]
        log_norm = peak + mx.log(mx.power(2.0, (x - peak) * _LOG2_E).sum(axis=-1, keepdims=True))
        return mx.exp(top - log_norm), ids

    @staticmethod
    def stack(parts, axis=0):
        return mx.stack(parts, axis=axis)

    broadcast_to, zeros_like = staticmethod(mx.broadcast_to), staticmethod(mx.zeros_like)

    @staticmethod
    def from_host(values, like):
        return mx.array(values, dtype=mx.float32)
