"""Chat templates as token streams: the prompt, an observation's continuation, SFT traces.

A multi-turn sample is built **token in, token out**: the model's turns are its generated ids,
never decoded and encoded again; only what the environment adds is tokenised, and only that
part. The rule that maps a conversation onto those ids (:func:`continuation`):

    the ids after a model turn are tokens(R[len(B):]), where B = the conversation's text so far
    (the rendered prompt + each turn as decoded, special tokens kept) and R = the chat template's
    rendering of the conversation with the new messages appended (generation prompt added).

It holds only when R starts with B (the template renders a past assistant turn exactly as the
model wrote it); otherwise :class:`TemplateMismatch` names both texts. Every chat template we
know renders an assistant message as its content verbatim, so the rule holds for a turn that
ended on the template's end-of-turn token (Qwen's ``<|im_end|>``) or a tool call's stop token.
Tokenising the new text alone can give other ids than tokenising the whole conversation would
(a merge across the boundary); the ids recorded are the ones the model conditioned on, so
training sees exactly what generation saw (the point), even where a re-tokenised history would
not.

:func:`prompt_ids` renders the first observation: a list of messages through the template
(with the environment's ``tools=``), text as it is; a tokenizer whose template does not write
the BOS token gets it prepended, as the single-turn prompts are (:mod:`asyncflow.tasks.layout`).

:data:`TOOL_TEMPLATE` is a real Hugging Face chat template (Jinja, set as
``tokenizer.chat_template``) for small models: the tools' names before the first message, tool
calls in the compact ``name(argument)`` form, tool results between ``<tool_response>`` tags, and an
answer that calls no tool ended by the EOS token (as the model ends it); with :func:`add_tool_tokens`
the four tags are one token each (and the tokenizer reads the EOS token's text as that token, as
Hugging Face chat tokenizers do: ``split_special_tokens`` off). :func:`trace_ids` turns an SFT trace
(OpenAI-style messages with tool calls) into ids and a loss mask over the assistant's tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

from transformers import PreTrainedTokenizerBase

from asyncflow.agents.env import Observation, Tokens
from asyncflow.agents.tools import TOOL_TOKENS

TOOL_TEMPLATE = (
    "{%- if tools -%}"
    "{%- for t in tools -%}{{ t.function.name if t.function is defined else t.name }}"
    "{{ ',' if not loop.last }}{%- endfor -%}:"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' or m.role == 'system' -%}{{ m.content }}"
    "{%- elif m.role == 'assistant' -%}{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] -%}{%- set a = c.function.arguments -%}"
    "{%- if a is mapping and a | length == 1 -%}<tool_call>{{ c.function.name }}({{ a.values() | first }})</tool_call>"
    "{%- else -%}<tool_call>{{ {'name': c.function.name, 'arguments': a} | tojson }}</tool_call>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if not m.tool_calls and not (m.content or '').endswith('</tool_call>') -%}{{ eos_token }}{%- endif -%}"
    "{%- elif m.role == 'tool' -%}<tool_response>{{ m.content }}</tool_response>"
    "{%- endif -%}"
    "{%- endfor -%}"
)


class TemplateMismatch(ValueError):
    """The chat template does not render the conversation as the model wrote it (module doc)."""


def add_tool_tokens(tokenizer: PreTrainedTokenizerBase) -> int:
    """Make the tool tags one (ordinary, not special) token each and let rendered text name the
    special tokens (a template writes the EOS token's text); how many tokens were new."""
    tokenizer.split_special_tokens = False
    return int(tokenizer.add_tokens(list(TOOL_TOKENS)))


def tokens(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """``text``'s ids, no special tokens added."""
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]],
           tools: list[dict[str, Any]] | None = None, generation_prompt: bool = True) -> str:
    """The chat template's text of ``messages`` (with ``tools``)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("an environment gave chat messages but the tokenizer has no chat template: set one "
                         "(tokenizer.chat_template, e.g. asyncflow.agents.chat.TOOL_TEMPLATE) or return text")
    text = tokenizer.apply_chat_template([dict(m) for m in messages], tools=list(tools) if tools else None,
                                         add_generation_prompt=generation_prompt, tokenize=False)
    return cast(str, text)


def decode(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> str:
    """Ids as text with special tokens kept (what a template renders them as)."""
    return cast(str, tokenizer.decode(list(ids), skip_special_tokens=False))


def prompt_ids(tokenizer: PreTrainedTokenizerBase, first: Observation,
               tools: list[dict[str, Any]] | None) -> tuple[list[int], str]:
    """The ids of an episode's first observation (module doc) and its text (for :func:`continuation`)."""
    if isinstance(first, Tokens):
        return list(first.ids), decode(tokenizer, first.ids)
    text = render(tokenizer, first, tools) if isinstance(first, list) else first
    ids = tokens(tokenizer, text)
    bos = tokenizer.bos_token
    if tokenizer.bos_token_id is not None and not (bos and text.startswith(bos)):
        ids = [tokenizer.bos_token_id, *ids]
    return ids, text


def continuation(tokenizer: PreTrainedTokenizerBase, before: str, messages: Sequence[Mapping[str, Any]],
                 tools: list[dict[str, Any]] | None) -> str:
    """The text the template adds after ``before`` for ``messages`` (the whole conversation with
    the new messages last; generation prompt added): the module doc's rule."""
    after = render(tokenizer, messages, tools)
    if not after.startswith(before):
        at = next((i for i, (a, b) in enumerate(zip(after, before)) if a != b), min(len(after), len(before)))
        raise TemplateMismatch(f"the chat template renders the conversation differently from what the model wrote, "
                               f"at character {at}: rendered {after[at:at + 40]!r}, written {before[at:at + 40]!r}")
    return after[len(before):]


def trace_ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]],
              tools: list[dict[str, Any]] | None = None) -> tuple[list[int], list[int], int]:
    """An SFT trace (a user message, then assistant turns and the tool or user messages between
    them) as ``(ids, loss mask, prompt length)``: each segment tokenised alone, as rollout builds
    it (:func:`continuation`); the mask is 1 on the assistant's tokens, and the last assistant turn
    ends with EOS (added when the template does not write it)."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids, text = prompt_ids(tokenizer, [dict(m) for m in messages[:first]], tools)
    mask, n_prompt = [0] * len(ids), len(ids)
    i = first
    while i < len(messages):
        turn = render(tokenizer, messages[: i + 1], tools, generation_prompt=False)
        if not turn.startswith(text):
            raise TemplateMismatch(f"trace message {i}: the template does not extend the conversation's text")
        turn_ids = tokens(tokenizer, turn[len(text):])
        last = not any(m["role"] == "assistant" for m in messages[i + 1:])
        if last and (not turn_ids or turn_ids[-1] != tokenizer.eos_token_id):
            turn_ids.append(tokenizer.eos_token_id)
        ids, mask, text = ids + turn_ids, mask + [1] * len(turn_ids), turn
        j = i + 1
        while j < len(messages) and messages[j]["role"] != "assistant":
            j += 1
        if j < len(messages):  # the observation between two assistant turns
            obs = tokens(tokenizer, continuation(tokenizer, text, messages[:j], tools))
            ids, mask = ids + obs, mask + [0] * len(obs)
            text = render(tokenizer, messages[:j], tools)
        i = j
    return ids, mask, n_prompt
