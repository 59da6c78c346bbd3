"""``python -m llmrl.config``: print the configuration reference (docs/configuration.md)."""

from llmrl.config.reference import reference_markdown

print(reference_markdown(), end="")
