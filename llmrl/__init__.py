"""llmrl: reinforcement-learning post-training of language models.

``llmrl train CONFIG`` trains from the shell, `llmrl.train(config)` from Python (docs/python_api.md).
"""

from typing import Any

__all__ = ["train"]


def __getattr__(name: str) -> Any:
    # Importing the trainer takes seconds (torch, transformers): only a caller of `train` pays for it,
    # not every `import llmrl.config`.
    if name == "train":
        from llmrl.api import train

        return train
    raise AttributeError(f"module 'llmrl' has no attribute {name!r}")
