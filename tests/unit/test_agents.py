"""RewardOnlyAgent: batched requests, token bookkeeping, multi-turn exactness, failure isolation, splits."""

import asyncio
import re
import threading
import time

import pytest
from scripted_inference import (
    COMPLETION_OFFSET,
    EchoAgent,
    ScriptedInference,
    answer_of,
    encode,
    logprob,
    render,
)

from llmrl.agents import EpochSampler, Problem, evaluation_metrics, make_prompt
from llmrl.types import ChatMessage, GenerationArgs, InferenceRequest


def run(coroutine):
    return asyncio.run(coroutine)


def test_one_concurrent_request_per_group_and_exact_tokens():
    inference = ScriptedInference(
        lambda prompt, i: answer_of(prompt) if i % 2 == 0 else "wrong", policy_version=7
    )
    agent = EchoAgent(env_id="echo", eval_size=4)
    groups = run(agent.group_rollouts(inference, 3, 4, GenerationArgs(max_tokens=10)))

    assert len(groups) == 3 and len(inference.requests) == 3
    assert inference.max_in_flight == 3  # issued together, so the engine can batch them
    assert all(r.n == 4 and r.generation_args.max_tokens == 10 for r in inference.requests)
    assert len({g.group_id for g in groups}) == 3
    for group in groups:
        assert [r.reward for r in group.rollouts] == [1.0, 0.0, 1.0, 0.0]
        problem_ids = {r.problem_id for r in group.rollouts}
        assert len(problem_ids) == 1
        (problem_id,) = problem_ids
        rollout = group.rollouts[0]
        prompt_ids = encode(f"say a{problem_id[1:]}")
        completion_ids = [ord(c) + COMPLETION_OFFSET for c in f"a{problem_id[1:]}"]
        assert rollout.trajectory == [prompt_ids, completion_ids]
        assert rollout.generation_mask == [[False] * len(prompt_ids), [True] * len(completion_ids)]
        assert rollout.logprobs == [[0.0] * len(prompt_ids), [logprob(i) for i in range(len(completion_ids))]]
        assert (rollout.env_id, rollout.status, rollout.policy_version) == ("echo", "ok", 7)
        assert rollout.text == [f"say a{problem_id[1:]}", f"a{problem_id[1:]}"]


def test_agent_generation_args_override_the_callers():
    inference = ScriptedInference("x")
    agent = EchoAgent(eval_size=4, generation_args={"max_tokens": 3, "stop": ["\n"]})
    run(agent.group_rollouts(inference, 1, 2, GenerationArgs(max_tokens=50, temperature=0.5)))
    args = inference.requests[0].generation_args
    assert (args.max_tokens, args.stop, args.temperature) == (3, ("\n",), 0.5)


def test_truncated_completions_are_flagged():
    inference = ScriptedInference("a much too long answer")
    (group,) = run(EchoAgent(eval_size=4).group_rollouts(inference, 1, 2, GenerationArgs(max_tokens=5)))
    assert all(r.truncated and r.num_generated == 5 for r in group.rollouts)


class RetryAgent(EchoAgent):
    """Multi-turn: a wrong reply gets 'no, say aN' back until the model answers or turns run out."""

    def observe(self, turn, response, problem):
        return None if response.text == problem.answer else f"no, say {problem.answer}"


@pytest.mark.parametrize("chat", [False, True])
def test_multi_turn_keeps_the_exact_token_ids_of_every_turn(chat):
    replies = iter(["first try", "second try", "a0"] * 2)
    inference = ScriptedInference(lambda prompt, i: next(replies))
    agent = RetryAgent(num_problems=5, chat=chat, max_turns=4, eval_size=1)
    agent._splits = (agent.prompts()[:1], agent.prompts()[1:2])  # train on p0 only
    (group,) = run(agent.group_rollouts(inference, 1, 1))
    (rollout,) = group.rollouts

    assert rollout.status == "ok" and rollout.reward == 1.0
    assert [decode_segment(s) for s in rollout.trajectory] == [
        render(make_prompt("say a0", chat=chat)),
        "first try",
        render("no, say a0" if not chat else [ChatMessage(role="user", content="no, say a0")]),
        "second try",
        render("no, say a0" if not chat else [ChatMessage(role="user", content="no, say a0")]),
        "a0",
    ]
    assert [all(m) for m in rollout.generation_mask] == [False, True, False, True, False, True]
    assert [any(m) for m in rollout.generation_mask] == [False, True, False, True, False, True]
    # Each follow-up request carried the exact ids so far, model ids (offset) included.
    first, second, third = inference.requests
    assert first.prompt_token_ids is None
    assert second.prompt_token_ids == rollout.trajectory[0] + rollout.trajectory[1]
    assert third.prompt_token_ids == [t for s in rollout.trajectory[:4] for t in s]
    assert all(
        t >= COMPLETION_OFFSET for t in rollout.trajectory[1] + rollout.trajectory[3] + rollout.trajectory[5]
    )
    assert all(
        lp == 0.0
        for s, m in zip(rollout.logprobs, rollout.generation_mask, strict=True)
        if not m[0]
        for lp in s
    )


def decode_segment(ids):
    return "".join(chr(i % COMPLETION_OFFSET) for i in ids)


def test_multi_turn_stops_at_max_turns_and_scores_the_last_turn():
    inference = ScriptedInference("never right")
    agent = RetryAgent(num_problems=5, max_turns=3, eval_size=1)
    (group,) = run(agent.group_rollouts(inference, 1, 2))
    assert len(inference.requests) == 1 + 2 * 2  # one group request, then two follow-ups per sample
    assert all(len(r.trajectory) == 2 * 3 and r.reward == 0.0 for r in group.rollouts)


def test_engine_that_drops_the_prefix_gives_a_placeholder():
    class ForgetfulInference(ScriptedInference):
        async def agenerate(self, request):
            return await super().agenerate(request.model_copy(update={"prompt_token_ids": None}))

    agent = RetryAgent(num_problems=5, max_turns=2, eval_size=1)
    (group,) = run(agent.group_rollouts(ForgetfulInference("wrong"), 1, 1))
    assert group.rollouts[0].status == "placeholder"
    assert "did not continue from prompt_token_ids" in group.rollouts[0].failure_reason


# ---- failure isolation ---------------------------------------------------------------------


class FlakyAgent(EchoAgent):
    """Reward raises, hangs or returns NaN for chosen completions."""

    def reward(self, response, problem):
        if response.text == "boom":
            raise KeyError("bad row")
        if response.text == "hang":
            time.sleep(2)
        if response.text == "nan":
            return float("nan")
        return super().reward(response, problem)


def test_a_failing_reward_only_replaces_its_own_rollout():
    inference = ScriptedInference(lambda prompt, i: ["boom", "nan", answer_of(prompt), "x"][i])
    agent = FlakyAgent(eval_size=4)
    groups = run(agent.group_rollouts(inference, 2, 4))
    for group in groups:
        statuses = [r.status for r in group.rollouts]
        assert statuses == ["placeholder", "placeholder", "ok", "ok"]
        assert re.fullmatch(
            r"reward: \S*test_agents\.py:\d+ in FlakyAgent\.reward: KeyError: 'bad row'",
            group.rollouts[0].failure_reason,
        )
        assert group.rollouts[1].failure_reason.endswith("returned nan; expected a finite number or a Reward")
        assert [r.reward for r in group.rollouts] == [0.0, 0.0, 1.0, 0.0]
    assert agent.pop_metrics() == {"failures/reward": 4.0, "placeholders": 4.0}
    assert agent.pop_metrics() == {}


def test_a_hanging_reward_times_out_without_holding_up_the_batch():
    inference = ScriptedInference(lambda prompt, i: "hang" if i == 0 else answer_of(prompt))
    agent = FlakyAgent(eval_size=4, reward_timeout_s=0.2)
    start = time.monotonic()
    groups = run(agent.group_rollouts(inference, 3, 2))
    assert time.monotonic() - start < 1.5  # the three hung threads are abandoned, not awaited
    assert [[r.status for r in g.rollouts] for g in groups] == [["placeholder", "ok"]] * 3
    assert groups[0].rollouts[0].failure_reason == "reward: timed out after 0.2 s"


def test_env_workers_are_reused_and_a_hung_call_keeps_only_its_own():
    from llmrl.agents.workers import DaemonWorkers

    workers = DaemonWorkers(idle_s=0.3)
    release = threading.Event()
    done: list[int] = []
    workers.submit(release.wait)  # hangs until released: its worker stays busy
    for round_ in range(3):
        finished = threading.Event()
        workers.submit(lambda r=round_, event=finished: (done.append(r), event.set()))
        assert finished.wait(2)
        time.sleep(0.01)  # the worker goes back to idle after its job
    # One worker for the hung call and one reused by the three others.
    assert sum(t.name == "llmrl-env" for t in threading.enumerate()) >= 2
    assert len(workers._idle) == 1 and done == [0, 1, 2]
    release.set()
    deadline = time.monotonic() + 3
    while workers._idle and time.monotonic() < deadline:  # idle workers exit after idle_s
        time.sleep(0.05)
    assert workers._idle == []


def test_inference_failures_and_timeouts_replace_only_their_group():
    def reply(prompt, i):
        if prompt.endswith("a1"):
            raise ConnectionError("engine went away")
        return answer_of(prompt)

    inference = ScriptedInference(reply, delay_s=lambda prompt: 5.0 if prompt.endswith("a2") else 0.0)
    agent = EchoAgent(num_problems=3, eval_size=0, inference_timeout_s=0.2)
    start = time.monotonic()
    groups = run(agent.group_rollouts(inference, 3, 2))
    assert time.monotonic() - start < 2.0
    by_problem = {g.rollouts[0].problem_id: g for g in groups}
    assert [r.status for r in by_problem["p0"].rollouts] == ["ok", "ok"]
    assert by_problem["p1"].rollouts[0].failure_reason == "inference: ConnectionError: engine went away"
    assert by_problem["p2"].rollouts[0].failure_reason == "inference: timed out after 0.2 s"
    assert all(
        r.status == "placeholder" and r.trajectory == [] for p in ("p1", "p2") for r in by_problem[p].rollouts
    )
    assert agent.pop_metrics() == {"failures/inference": 2.0, "placeholders": 4.0}


def test_a_failing_observe_is_isolated_too():
    class BadObserver(EchoAgent):
        def observe(self, turn, response, problem):
            return 42  # not a string

    (group,) = run(BadObserver(eval_size=4, max_turns=2).group_rollouts(ScriptedInference("x"), 1, 2))
    assert all(
        re.fullmatch(
            r"observe: \S*test_agents\.py:\d+ in .*BadObserver\.observe: returned 42; "
            r"expected a string \(the next user message\) or None",
            r.failure_reason,
        )
        for r in group.rollouts
    )


def test_async_rewards_are_awaited():
    class AsyncAgent(EchoAgent):
        async def reward(self, response, problem):
            await asyncio.sleep(0)
            return 0.5

    (group,) = run(AsyncAgent(eval_size=4).group_rollouts(ScriptedInference("x"), 1, 2))
    assert [r.reward for r in group.rollouts] == [0.5, 0.5]


# ---- problems: held-out split and sampler -------------------------------------------------------


def test_held_out_split_is_fixed_and_disjoint_and_the_seed_orders_training():
    a, b = EchoAgent(eval_size=5, seed=0), EchoAgent(eval_size=5, seed=1)
    assert [p.id for p in a.eval_problems] == [p.id for p in b.eval_problems]
    assert len(a.eval_problems) == 5 and len(a.train_problems) == 15
    assert not {p.id for p in a.eval_problems} & {p.id for p in a.train_problems}
    draws_a = a._sampler.take(15)
    draws_b = b._sampler.take(15)
    assert sorted(draws_a) == sorted(draws_b) == list(range(15)) and draws_a != draws_b


def test_too_large_eval_size_and_duplicate_ids_are_errors():
    with pytest.raises(ValueError, match="eval_size=20 leaves no training problems"):
        len(EchoAgent(eval_size=20).train_problems)

    class Duplicates(EchoAgent):
        def prompts(self):
            return [Problem("same", "q1"), Problem("same", "q2")]

    with pytest.raises(ValueError, match="repeated problem ids"):
        len(Duplicates(eval_size=0).train_problems)


def test_epoch_sampler_visits_every_problem_once_per_epoch():
    sampler = EpochSampler(7, seed=3)
    draws = sampler.take(7 * 3 + 2)
    for epoch in range(3):
        assert sorted(draws[7 * epoch : 7 * epoch + 7]) == list(range(7))
    assert draws[:7] != draws[7:14]  # a fresh permutation each epoch
    assert sampler.epoch == 3 and sampler.position == 2
    assert EpochSampler(7, seed=3).take(23) == draws


def test_epoch_sampler_resumes_from_a_saved_cursor():
    sampler = EpochSampler(10, seed=5)
    sampler.take(13)
    state = sampler.state_dict()
    expected = sampler.take(12)
    resumed = EpochSampler(10, seed=5)
    resumed.load_state_dict(state)
    assert resumed.take(12) == expected
    with pytest.raises(ValueError, match="size=11"):
        EpochSampler(11, seed=5).load_state_dict(state)


def test_agent_state_dict_resumes_the_problem_order():
    inference = ScriptedInference("x")
    agent = EchoAgent(eval_size=4, seed=2)
    run(agent.group_rollouts(inference, 5, 1))
    state = agent.state_dict()
    expected = [g.rollouts[0].problem_id for g in run(agent.group_rollouts(inference, 20, 1))]
    resumed = EchoAgent(eval_size=4, seed=2)
    resumed.load_state_dict(state)
    groups = run(resumed.group_rollouts(inference, 20, 1))
    assert [g.rollouts[0].problem_id for g in groups] == expected
    assert groups[0].group_id == "EchoAgent/5"


# ---- evaluation -------------------------------------------------------------------------------


def test_evaluate_samples_held_out_problems_and_decodes_greedily():
    def reply(prompt, i):
        return answer_of(prompt) if i == 0 else "nope"

    inference = ScriptedInference(reply)
    agent = EchoAgent(eval_size=6)
    response = run(
        agent.evaluate(
            inference, 4, samples_per_prompt=3, greedy=True, generation_args=GenerationArgs(temperature=0.8)
        )
    )
    assert [r.problem_id for r in response.results] == [p.id for p in agent.eval_problems[:4]]
    assert all(r.rewards == [1.0, 0.0, 0.0] and r.greedy_reward == 1.0 for r in response.results)
    temperatures = sorted({(r.n, r.generation_args.temperature) for r in inference.requests})
    assert temperatures == [(1, 0.0), (3, 0.8)]
    metrics = evaluation_metrics(response)
    assert metrics["greedy_accuracy"] == 1.0 and metrics["accuracy"] == pytest.approx(1 / 3)


def test_continuation_requests_validate_their_prefix():
    request = InferenceRequest(prompt="more", prompt_token_ids=[5, 6], n=1)
    assert InferenceRequest.model_validate_json(request.model_dump_json()) == request
    for bad in ([], [1, -2]):
        with pytest.raises(ValueError, match="prompt_token_ids must be a non-empty list of ids >= 0"):
            InferenceRequest(prompt="more", prompt_token_ids=bad)


def test_seeded_calls_give_every_request_its_own_repeatable_seed():
    def seeds(agent_seed: int, args: GenerationArgs) -> list[int | None]:
        inference = ScriptedInference("x")
        agent = EchoAgent(eval_size=4, seed=agent_seed)
        run(agent.group_rollouts(inference, 3, 2, args))
        run(agent.evaluate(inference, 2, samples_per_prompt=2, greedy=True, generation_args=args))
        return [r.generation_args.seed for r in inference.requests]

    seeded = seeds(0, GenerationArgs(seed=7))
    assert len(set(seeded)) == len(seeded) == 3 + 2 * 2  # 3 groups, then 2 problems x (sampled, greedy)
    assert seeds(0, GenerationArgs(seed=7)) == seeded
    assert seeds(0, GenerationArgs(seed=8)) != seeded
    assert seeds(0, GenerationArgs()) == [None] * len(seeded)  # unseeded: the backend decides
