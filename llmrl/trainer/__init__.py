"""The trainer: the RL loop (`Trainer`), checkpoints, the policy update and what a run shows."""

from llmrl.trainer.trainer import Trainer

__all__ = ["Trainer"]
