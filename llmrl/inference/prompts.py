"""Prompts of the embedded engine: a request's prompt as token ids, checked against the model.

A string is tokenized as is (with the tokenizer's special tokens), chat messages through the
tokenizer's chat template with the generation prompt and the request's ``chat_template_kwargs``.
With ``prompt_token_ids`` (multi-turn) those ids come first, used verbatim, and the prompt is
appended as the next turn: a string without special tokens, messages rendered as a follow-up turn
(what the template puts after an assistant message, minus the eos the model already produced,
then the new turn).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmrl.inference.interface import RequestRejected
from llmrl.types import ChatMessage, GenerationArgs, InferenceRequest

_MOST_TOKENS_BEYOND_BYTES = 8
"""Tokens a prompt may have beyond the bytes of its text: those a tokenizer adds (BOS, EOS, a prefix
space); every other token covers at least one byte of the text, a special token's name included."""


def prompt_token_ids(
    tokenizer: Any, request: InferenceRequest, *, context: int, vocab_size: int
) -> list[int]:
    """The ids `request`'s completions follow; `RequestRejected` for a prompt that fills the `context`,
    `max_tokens` beyond it, or ids outside the vocabulary (prompt or stop token ids)."""
    args = request.generation_args
    prompt_ids = request_prompt_ids(tokenizer, request)
    if not prompt_ids:
        raise RequestRejected("prompt: it encodes to no tokens")
    if len(prompt_ids) >= context:
        raise RequestRejected(
            f"prompt: {len(prompt_ids)} tokens leave no room for a completion in the model's context of "
            f"{context} tokens"
        )
    if len(prompt_ids) + args.max_tokens > context:
        raise RequestRejected(
            f"max_tokens: {args.max_tokens} completion tokens after a {len(prompt_ids)}-token prompt exceed "
            f"the model's context of {context} tokens (at most {context - len(prompt_ids)} fit)"
        )
    for field_name, ids in (
        ("prompt_token_ids", request.prompt_token_ids or ()),
        ("stop_token_ids", args.stop_token_ids),
    ):
        outside = sorted({t for t in ids if t >= vocab_size})
        if outside:
            raise RequestRejected(
                f"{field_name}: {outside[:5]} outside the vocabulary of {vocab_size} tokens"
            )
    return prompt_ids


def overlong_prompts(
    tokenizer: Any, prompts: Sequence[str | list[ChatMessage]], args: GenerationArgs, max_tokens: int
) -> dict[int, int]:
    """The prompts (by index) of more than `max_tokens` tokens as a request with `args` renders them,
    each with its count. Only those whose text is long enough to be over are tokenized: a data set's
    worth of short prompts costs one template rendering each."""
    template_kwargs = args.chat_template_kwargs or {}
    over = {}
    for index, prompt in enumerate(prompts):
        text = (
            prompt
            if isinstance(prompt, str) or getattr(tokenizer, "chat_template", None) is None
            else tokenizer.apply_chat_template(
                [m.model_dump() for m in prompt],
                add_generation_prompt=True,
                tokenize=False,
                **template_kwargs,
            )
        )
        if isinstance(text, str) and len(text.encode()) + _MOST_TOKENS_BEYOND_BYTES <= max_tokens:
            continue
        count = len(request_prompt_ids(tokenizer, InferenceRequest(prompt=prompt, generation_args=args)))
        if count > max_tokens:
            over[index] = count
    return over


def request_prompt_ids(tokenizer: Any, request: InferenceRequest) -> list[int]:
    """Prompt ids: the chat template or the plain text, after `prompt_token_ids` when given. Unchecked:
    the client of a server that checks prompts itself (vLLM) renders continuations with this too."""
    prefix, prompt = request.prompt_token_ids, request.prompt
    if isinstance(prompt, str):
        ids = tokenizer(prompt, add_special_tokens=prefix is None)["input_ids"]
        return list(prefix or []) + list(ids)
    if getattr(tokenizer, "chat_template", None) is None:
        raise RequestRejected(
            "prompt: chat messages need a tokenizer with a chat template; pass a string instead"
        )
    messages = [m.model_dump() for m in prompt]
    template_kwargs = request.generation_args.chat_template_kwargs or {}
    if prefix is None:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, **template_kwargs
        )
        return list(ids)
    return list(prefix) + follow_up_ids(tokenizer, prefix, messages, template_kwargs)


def follow_up_ids(
    tokenizer: Any, prefix: list[int], messages: list[dict[str, Any]], template_kwargs: dict[str, Any]
) -> list[int]:
    """Ids of `messages` as the next turn after a conversation whose ids (ending in a model turn) are
    `prefix`.

    The template renders a reference conversation with and without the new messages; the
    difference is the new turn. What the template writes after an assistant message (ChatML:
    ``<|im_end|>\n``) is prepended, minus the eos token when the model already produced it.
    """
    reply = "\u2063llmrl-reply\u2063"  # text no real conversation contains
    reference = [{"role": "user", "content": "?"}, {"role": "assistant", "content": reply}]

    def render(conversation: list[dict[str, Any]], **options: Any) -> str:
        return tokenizer.apply_chat_template(conversation, tokenize=False, **options, **template_kwargs)

    before = render(reference)
    after = render(reference + messages, add_generation_prompt=True)
    if reply not in before or not after.startswith(before):
        raise RequestRejected(
            "prompt: the tokenizer's chat template cannot render a follow-up turn after prompt_token_ids"
        )
    closing = before[before.rindex(reply) + len(reply) :]
    eos = getattr(tokenizer, "eos_token", None)
    if eos and closing.startswith(eos) and prefix[-1] == tokenizer.eos_token_id:
        closing = closing[len(eos) :]
    return list(tokenizer(closing + after[len(before) :], add_special_tokens=False)["input_ids"])
