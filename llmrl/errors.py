"""`UserError`: the base of the exceptions llmrl raises for its user's mistakes.

The CLI prints such an error's message and exits with status 2; any other exception is a bug and
keeps its traceback. It is a `ValueError`, so callers of the Python API may catch either.
"""


class UserError(ValueError):
    """What the user gave llmrl is wrong (a config field, a plug-in name, a model spec, a data file); the
    message says what."""


class ModelSpecError(UserError):
    """A model spec names nothing llmrl can load, or a model llmrl cannot train and serve alike."""
