"""`from dflash.backends.torch.trainer import TrainConfig, train`: the trainer's entry points. The trainer itself
lives in backends/torch/training/ (config, objective, attention, data, model, checkpoint, evaluate, loop)."""

from .training import TrainConfig, TrainResult, first_free_embedding_row, new_draft_spec, train

__all__ = ["TrainConfig", "TrainResult", "first_free_embedding_row", "new_draft_spec", "train"]
