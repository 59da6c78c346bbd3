"""An OpenEnv environment written as OpenEnv's documentation shows, and the two functions that let the model
play it (examples/openenv.yaml).

The environment asks a sum and answers each reply: reward 1 and done when the reply's first number is
right; otherwise "No, that is wrong." with the question again, up to three tries (then done, reward 0).
The question is drawn from the reset's seed, so every episode of a group gets the same one. The sums are
the tiny model's (``What is 23 + 45?``), so `tiny://arithmetic` can learn it.

llmrl serves `app` itself (``serve: {module: openenv_sums:app}``); any OpenEnv client reaches it the
same way when it runs on its own: ``uvicorn openenv_sums:app --port 8000``.
"""

from __future__ import annotations

import random
import re
from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State, create_app

MAX_TRIES = 3


class SumAction(Action):
    answer: str


class SumObservation(Observation):
    question: str


class SumsEnvironment(Environment):
    """One session: a 2-digit sum, asked again after each wrong answer."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # each session has its own instance and shares nothing

    def __init__(self):
        super().__init__()
        self._state = State()
        self.a = self.b = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> SumObservation:
        rng = random.Random(seed)
        self.a, self.b = rng.randint(10, 99), rng.randint(10, 99)
        self._state = State(episode_id=episode_id, step_count=0)
        return SumObservation(question=self.question())

    def step(self, action: SumAction, timeout_s: float | None = None, **kwargs: Any) -> SumObservation:
        self._state.step_count += 1
        number = re.search(r"-?\d+", action.answer)
        if number is not None and int(number.group()) == self.a + self.b:
            return SumObservation(question="", reward=1.0, done=True)
        return SumObservation(
            question=f"No, that is wrong. {self.question()}",
            reward=0.0,
            done=self._state.step_count >= MAX_TRIES,
        )

    @property
    def state(self) -> State:
        return self._state

    def question(self) -> str:
        return f"What is {self.a} + {self.b}?"


app = create_app(SumsEnvironment, SumAction, SumObservation, env_name="sums", max_concurrent_envs=256)


# ---- the two functions of the agent (TRL's observation -> messages, completion -> action) --------------


def observation_to_messages(observation: dict) -> str:
    """What the model reads: the question (OpenEnv's generic client gives observations as dicts)."""
    return observation["question"]


def completion_to_action(completion: str) -> dict:
    """The action the model's reply stands for: the reply as the answer."""
    return {"answer": completion}
