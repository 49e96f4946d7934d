"""The array namespace dflash.core.rules runs on, over torch tensors."""

from __future__ import annotations

import torch


class TorchOps:
    @staticmethod
    def sum(x, axis, keepdims=False):
        return x.sum(dim=axis, keepdim=keepdims)

    @staticmethod
    def cumsum(x, axis):
        return x.cumsum(axis)

    @staticmethod
    def where(condition, x, y):
        return torch.where(condition, x, y)

    @staticmethod
    def maximum(x, y):
        return x.clamp(min=y) if isinstance(y, (int, float)) else torch.maximum(x, y)

    @staticmethod
    def minimum(x, y):
        return x.clamp(max=y) if isinstance(y, (int, float)) else torch.minimum(x, y)

    tanh = staticmethod(torch.tanh)

    @staticmethod
    def gather(x, ids, axis):
        return x.gather(axis, ids)

    @staticmethod
    def scatter(like, ids, values, axis):
        return torch.zeros_like(like).scatter_(axis, ids, values.to(like.dtype))

    @staticmethod
    def concatenate(parts, axis):
        return torch.cat(parts, dim=axis)

    @staticmethod
    def token_ids(x):
        return x.long()

    @staticmethod
    def argmax(x, axis):
        return x.argmax(dim=axis)

    @staticmethod
    def softmax(x, axis):
        return torch.softmax(x.float(), dim=axis)

    @staticmethod
    def top_k(x, k):
        return x.topk(k, dim=-1)

    @staticmethod
    def top_probs(logits, k):
        return torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)

    @staticmethod
    def stack(parts, axis=0):
        return torch.stack(parts, dim=axis)

    @staticmethod
    def broadcast_to(x, shape):
        return x.expand(shape)

    zeros_like = staticmethod(torch.zeros_like)

    @staticmethod
    def from_host(values, like):
        return torch.tensor(values, dtype=torch.float32, device=like.device)
