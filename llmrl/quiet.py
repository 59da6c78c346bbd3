"""What the `llmrl` commands leave out unless run with ``--verbose``: the warnings, log lines below
ERROR and progress bars of the libraries llmrl runs on, every installed package but llmrl
(transformers' "Loading weights" bars and warnings, datasets' "Generating train split" bars,
math-verify's notes, verifiers' aborted rollouts), which would bury the run's own lines.

llmrl's own log lines and warnings stay, and so do those of the user's code outside installed
packages (reward functions, agent programs, plug-in modules) and every error. The switches are the
libraries' own where they have them. `datasets` (imported late: importing it takes about a second)
and verifiers read their switches from the environment as they are imported, so those are set there,
where the processes a command starts find them too (a managed vLLM server takes no datasets; its log
file keeps what vLLM tells it).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re
import warnings


def quiet_libraries() -> None:
    """Hide the warnings, log lines below ERROR and progress bars of every installed package but llmrl,
    for the rest of the process (environment variables the user set for datasets win)."""
    import transformers.utils.logging as transformers_logging
    from huggingface_hub.utils import disable_progress_bars
    from huggingface_hub.utils import logging as hub_logging

    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    hub_logging.set_verbosity_error()
    disable_progress_bars()
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("DATASETS_VERBOSITY", "error")
    # verifiers sets its loggers' level from this as it is imported. It logs an empty reply as an error, once
    # per rollout; llmrl counts and names an environment's real failures itself (agent_type verifiers).
    os.environ.setdefault("VF_LOG_LEVEL", "CRITICAL")
    libraries = sorted(_installed_libraries())
    for name in libraries:  # torch and vLLM set their own levels as they are imported, and keep them
        logging.getLogger(name).setLevel(logging.ERROR)
    # Matched against the module a warning is attributed to: a library's warning aimed at a call in
    # llmrl's code (its stacklevel) still shows, as llmrl's to fix.
    warnings.filterwarnings("ignore", module=rf"(?:{'|'.join(map(re.escape, libraries))})(?:\.|$)")


def _installed_libraries() -> set[str]:
    """The top-level modules of the installed distributions, llmrl's aside."""
    return set(importlib.metadata.packages_distributions()) - {"llmrl"}
