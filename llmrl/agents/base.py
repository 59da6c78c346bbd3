"""The agent contract: prompts in, scored token rollouts out.

An agent owns its problems and its reward; it talks to the model only through an
`InferenceInterface` and never sees the trainer. The trainer asks for `group_rollouts` (GRPO
groups: one problem, `group_size` samples) and `evaluate` (held-out problems, n samples each).
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import logging
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmrl.inference.interface import InferenceInterface
from llmrl.seeding import derive_seed
from llmrl.types import ChatMessage, EvaluationResponse, GenerationArgs, RolloutGroup, TokenRollout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Problem:
    """One problem of a task: what the model is asked and what the reward checks against."""

    id: str
    """Stable identifier, unique within its environment (shows up in rollouts and logs)."""
    prompt: str | list[ChatMessage]
    """Plain-text prompt, or chat messages for models with a chat template."""
    answer: Any = None
    """The reference the reward compares with (a number, a string, a list of tests, ...)."""
    row: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)
    """The data row it was made from (dataset environments: reward functions read its columns)."""
    origin: str | None = field(default=None, compare=False, repr=False)
    """Where it comes from, for messages about it: a data file and row (None: made by the agent)."""

    def described(self) -> str:
        """The problem as messages name it: its id, and its origin where known."""
        return f"problem {self.id}" + (f" ({self.origin})" if self.origin else "")


def make_prompt(text: str, *, system_prompt: str | None = None, chat: bool = True) -> str | list[ChatMessage]:
    """Chat messages (optional system message, then the user's text) or the plain text itself."""
    if chat:
        system = [ChatMessage(role="system", content=system_prompt)] if system_prompt else []
        return [*system, ChatMessage(role="user", content=text)]
    return f"{system_prompt}\n\n{text}" if system_prompt else text


def prompt_text(prompt: str | list[ChatMessage]) -> str:
    """A readable one-string form of a prompt, for logs and evaluation results."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{message.role}: {message.content}" for message in prompt)


def placeholder_rollout(env_id: str, problem_id: str, reason: str) -> TokenRollout:
    """A rollout that stands in for one that failed: keeps group shapes, excluded from the loss."""
    return TokenRollout(
        trajectory=[],
        generation_mask=[],
        env_id=env_id,
        problem_id=problem_id,
        status="placeholder",
        failure_reason=reason,
    )


INFERENCE_FAILURE = "inference:"
"""How the `failure_reason` of a placeholder begins when its inference call failed."""


def failed_in_inference(rollout: TokenRollout) -> bool:
    """True for a placeholder standing in for a rollout whose inference call failed (not its reward)."""
    return not rollout.is_valid and (rollout.failure_reason or "").startswith(INFERENCE_FAILURE)


DATA_FAILURE = "data"
"""The stage of a placeholder whose request the inference refused for what it holds (a prompt too long
for the model's context): its problem's data failed, and a rerun would fail it the same way, so it is
dropped from its batch, never a reason to stop the run."""


def failed_for_data(rollout: TokenRollout) -> bool:
    """True for a placeholder standing in for a rollout whose request was refused (`DATA_FAILURE`)."""
    return not rollout.is_valid and (rollout.failure_reason or "").startswith(f"{DATA_FAILURE}:")


UNREACHABLE_FAILURE = "unreachable"
"""The stage of a placeholder whose agent's environment server did not answer (a refused or lost
connection, no answer in time, a 5xx); its `failure_reason` goes on ``<server> unreachable since
<time>: <cause>``. Like a failed inference call it says more about a dead server than about the
policy: a batch with too many is refused and the run stops so that a rerun regenerates it
(`llmrl.rollouts.checks`), where an environment that fails one episode (``environment:``) only
leaves that episode out."""


class Reachability:
    """Since when a server has not answered: the first failure to answer since it last did."""

    def __init__(self) -> None:
        self.down_since: float | None = None

    def answered(self) -> None:
        self.down_since = None

    def down(self, server: str, cause: str) -> str:
        """``SERVER unreachable since TIME: CAUSE``, `server` having just failed to answer."""
        if self.down_since is None:
            self.down_since = time.time()
        since = datetime.datetime.fromtimestamp(self.down_since).isoformat(sep=" ", timespec="seconds")
        return f"{server} unreachable since {since}: {cause}"


def failed_unreachable(rollout: TokenRollout) -> bool:
    """True for a placeholder standing in for a rollout whose environment server did not answer
    (`UNREACHABLE_FAILURE`)."""
    return not rollout.is_valid and (rollout.failure_reason or "").startswith(f"{UNREACHABLE_FAILURE}:")


USER_CODE_STAGES = ("reward", "observe", "program")
"""The stages of an episode that run the user's code (reward functions, an agent's `reward` and
`observe`, an agent program); a placeholder's `failure_reason` begins with its stage and a colon."""


def failed_in_user_code(rollout: TokenRollout) -> bool:
    """True for a placeholder standing in for a rollout whose user code failed (`USER_CODE_STAGES`)."""
    stage = (rollout.failure_reason or "").split(":", 1)[0]
    return not rollout.is_valid and stage in USER_CODE_STAGES


_placeholder_counts: contextvars.ContextVar[Counter[tuple[str, str]] | None] = contextvars.ContextVar(
    "llmrl_placeholder_counts", default=None
)


@contextlib.contextmanager
def placeholders_logged_once(when: str) -> Iterator[None]:
    """Within the block (a step's draw, an evaluation), `log_placeholders` counts each distinct failure;
    at its end each is logged once with its count and `when` (``this step``), not once per problem.
    A block inside another counts into the outer one.

    The counts live in a context variable: the tasks the block starts (`asyncio.gather`) share them,
    and concurrent draws (an environment server's requests) keep their own."""
    if _placeholder_counts.get() is not None:
        yield
        return
    counts: Counter[tuple[str, str]] = Counter()
    token = _placeholder_counts.set(counts)
    try:
        yield
    finally:
        _placeholder_counts.reset(token)
        for (env_id, reason), count in counts.items():
            log.warning("%s: %s (x%d %s)", env_id, reason, count, when)


def log_placeholders(env_id: str, reason: str, count: int) -> None:
    """Log `count` rollouts of `env_id` replaced by placeholders for `reason`: at the end of the
    enclosing `placeholders_logged_once` block, else now."""
    counts = _placeholder_counts.get()
    if counts is None:
        log.warning("%s: %s (x%d)", env_id, reason, count)
    else:
        counts[(env_id, reason)] += count


def request_args(args: GenerationArgs, *keys: object) -> GenerationArgs:
    """`args` for one request: a seeded `args` gets its own seed derived from ``(seed, *keys)``.

    Agents call this with keys that name the request (environment, group or problem, sample, turn),
    so a seeded run samples the same tokens for the same request whatever order requests are
    served in (concurrent rewards, multi-turn episodes, a run resumed mid-way). Unseeded `args` are
    returned unchanged and the inference backend picks the randomness.
    """
    if args.seed is None:
        return args
    return args.model_copy(update={"seed": derive_seed(args.seed, *keys)})


def has_signal(group: RolloutGroup) -> bool:
    """True when the group's valid rewards differ, i.e. GRPO advantages are not all zero."""
    rewards = {r.reward for r in group.rollouts if r.is_valid}
    return len(rewards) > 1


@dataclass(frozen=True)
class PromptRoom:
    """What a problem's first prompt must fit: the context of the model that generates, less the
    completion's `max_tokens`; and what to do with prompts that do not."""

    context: int
    """Prompt and completion tokens the model generates over."""
    overlong: Callable[[Sequence[str | list[ChatMessage]], GenerationArgs, int], dict[int, int]]
    """The prompts (by index) of more tokens than the limit, with their counts, as the policy's
    tokenizer renders them under the given args (`llmrl.inference.prompts.overlong_prompts`)."""
    refuse: bool
    """Stop before training when any prompt does not fit, rather than skip it."""


class Agent(ABC):
    """An environment the trainer can draw rollout groups from and evaluate on."""

    env_id: str

    @abstractmethod
    async def group_rollouts(
        self,
        inference: InferenceInterface,
        num_groups: int,
        group_size: int,
        generation_args: GenerationArgs | None = None,
    ) -> list[RolloutGroup]:
        """`num_groups` training problems, `group_size` scored samples each; never raises for one bad
        sample."""

    @abstractmethod
    async def evaluate(
        self,
        inference: InferenceInterface,
        num_prompts: int,
        *,
        samples_per_prompt: int = 1,
        greedy: bool = False,
        generation_args: GenerationArgs | None = None,
    ) -> EvaluationResponse:
        """The first `num_prompts` held-out problems, sampled `samples_per_prompt` times (plus greedily)."""

    def check_problems(self) -> None:
        """Load and validate the problems now, so a bad dataset fails before any model is loaded."""
        return None  # agents without a local problem set (e.g. remote ones) have nothing to check

    def drop_overlong_prompts(self, room: PromptRoom, generation_args: GenerationArgs) -> None:
        """Before any problem is drawn: leave out the problems whose prompt leaves no room for
        `generation_args.max_tokens` (as this agent sets it) in `room.context`, with one warning naming
        them, or (`room.refuse`) raise `UserError` naming them.

        Agents whose prompts are known only as they run (remote ones, agent programs, later turns)
        meet such a prompt as a `DATA_FAILURE` of its request instead."""
        del room, generation_args

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must save to resume the problem order."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`."""
        del state

    def pop_metrics(self) -> dict[str, float]:
        """Counters (failures, placeholders, ...) accumulated since the last call."""
        return {}
