"""Reward functions as a TRL user writes them (`GRPOTrainer(reward_funcs=[...])`), used by
examples/trl_reward_functions.yaml without edits. TRL calls each with lists, one entry per
completion: ``prompts``, ``completions`` (message lists for conversational data),
``completion_ids``, and every other dataset column (here ``solution``).
"""

import re

from math_verify import parse, verify


def accuracy(completions, solution, **kwargs):
    """1.0 when the answer (in <answer> tags, else the whole reply) equals the solution by math-verify;
    None (does not apply) when no answer can be read."""
    rewards = []
    for completion, reference in zip(completions, solution, strict=True):
        content = completion[0]["content"] if isinstance(completion, list) else completion
        tagged = re.search(r"<answer>(.*?)</answer>", content, re.DOTALL)
        answer = parse(tagged.group(1) if tagged else content, parsing_timeout=None)
        rewards.append(
            None
            if not answer
            else float(verify(parse(reference, parsing_timeout=None), answer, timeout_seconds=None))
        )
    return rewards


def format(completions, **kwargs):  # noqa: A001 - TRL's examples name it so
    """1.0 when the reply reasons in <think>...</think> and then answers in <answer>...</answer>."""
    pattern = re.compile(r"^<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)
    contents = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(bool(pattern.match(content))) for content in contents]
