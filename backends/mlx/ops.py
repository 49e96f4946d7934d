"""The array namespace dflash.core.rules and dflash.core.proposals run on, over mx.arrays."""

from __future__ import annotations

import math

import mlx.core as mx

_CHUNK = 64  # top_probs: logits per chunk of the vocabulary
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
        """A partition, then a sort of k (a full argsort of the vocabulary costs more than a draft on a CPU)."""
        ids = mx.argpartition(-x, kth=k - 1, axis=-1)[..., :k]
        top = mx.take_along_axis(x, ids, axis=-1)
        order = mx.argsort(-top, axis=-1)
        return mx.take_along_axis(top, order, axis=-1), mx.take_along_axis(ids, order, axis=-1).astype(mx.int32)

    @staticmethod
    def top_probs(logits, k):
        """top_k(softmax(logits)), without a softmax or a partition over the whole vocabulary: on MLX's CPU backend
        both cost more than a small draft's layers (exp ~12 ns an element, a partition of 15 x 4096 ~0.6 ms). The k
        largest logits lie in the k chunks of CHUNK whose maxima are largest (any other chunk's elements are below k
        maxima), so one partition runs over those chunks' k * CHUNK logits; the normaliser takes 2^x, ~2.5x exp's
        speed there. Exact: the same tokens as a partition of the softmax (ties aside), probabilities within 1e-6."""
        x = logits.astype(mx.float32)
        *lead, v = x.shape
        if k * _CHUNK >= v:
            ids = mx.argpartition(-x, kth=k - 1, axis=-1)[..., :k]
        else:
            if v % _CHUNK:  # (pad to whole chunks with -inf, which no chunk maximum or top-k takes)
                x = mx.concatenate([x, mx.full((*lead, _CHUNK - v % _CHUNK), -mx.inf, dtype=x.dtype)], axis=-1)
            chunks = x.reshape(*lead, -1, _CHUNK)
            best = mx.argpartition(-chunks.max(axis=-1), kth=k - 1, axis=-1)[..., :k]  # (..., k) chunk ids
            pool = mx.take_along_axis(chunks, best[..., None], axis=-2).reshape(*lead, k * _CHUNK)
            j = mx.argpartition(-pool, kth=k - 1, axis=-1)[..., :k]
            ids = mx.take_along_axis(best, j // _CHUNK, axis=-1) * _CHUNK + j % _CHUNK
        top = mx.take_along_axis(x, ids, axis=-1)
        order = mx.argsort(-top, axis=-1)
        top, ids = mx.take_along_axis(top, order, axis=-1), mx.take_along_axis(ids, order, axis=-1)
        peak = x.max(axis=-1, keepdims=True)
        log_norm = peak + mx.log(mx.power(2.0, (x - peak) * _LOG2_E).sum(axis=-1, keepdims=True))
        return mx.exp(top - log_norm), ids.astype(mx.int32)

    @staticmethod
    def stack(parts, axis=0):
        return mx.stack(parts, axis=axis)

    broadcast_to, zeros_like = staticmethod(mx.broadcast_to), staticmethod(mx.zeros_like)

    @staticmethod
    def from_host(values, like):
        return mx.array(values, dtype=mx.float32)
