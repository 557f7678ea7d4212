"""Reasoning in a model's output, as vLLM's ``--reasoning-parser`` separates it from the answer.

Both parsers read ``<think>...</think>``: the reasoning runs up to ``</think>`` and the rest is
the answer's content (an output that ends before it is all reasoning). Where the reasoning starts:

- ``qwen3``: where the output opens ``<think>`` (after any whitespace), or at the output's start
  when the prompt ends with ``<think>`` (templates that open it for the model: Qwen3-Thinking's,
  QwQ's, Qwen3.5's) or goes on with a final message whose block is open. Otherwise the output is
  all content (``enable_thinking: false`` templates close an empty block in the prompt).
- ``deepseek_r1``: at the output's start (R1's template opens ``<think>`` in the prompt; one that
  the model writes itself is dropped).

``ReasoningStream.feed`` reads the output as it streams and gives the (reasoning, content) that
can be handed out now: it holds back only text that may be the start of a tag. A whole output is
split by feeding it at once (``split_reasoning``), so a stream and a whole answer agree.
"""

from __future__ import annotations

import dataclasses

from minengine.sampling_params import SamplingParams
from minengine.server.tool_calls import partial_tag
from minengine.structured import think_ids

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def prompt_opens_reasoning(prompt: str, final: str | None = None) -> bool:
    """Whether the output goes on with reasoning: ``prompt`` ends with ``<think>`` (a template that
    opens the block for the model), or ``final`` (the text of a final message the output goes on
    with: ``continue_final_message``) has a block it has not closed. A ``<think>`` elsewhere in
    the prompt (a user asking what it means) opens nothing."""
    if prompt.rstrip().endswith(START):
        return True
    return final is not None and final.rfind(START) > final.rfind(END)


def grammar_after_reasoning(params: SamplingParams, name: str | None, prompt_opens: bool, tokenizer) -> SamplingParams:
    """``params`` whose structured outputs (if any) start after the output's reasoning, as vLLM
    applies a grammar with a reasoning parser (``name``): after the ``</think>`` of an output that
    reasons as this module reads it (deepseek_r1's always; qwen3's when the prompt opened the
    block, ``prompt_opens``, or the output opens it with its first token). Unchanged without a
    parser, or with a tokenizer whose tags are not single tokens (the grammar then starts at the
    first token)."""
    spec = params.structured_outputs
    if spec is None or name is None or think_ids(tokenizer) is None:
        return params
    reasoning = "open" if name == "deepseek_r1" or prompt_opens else "may_open"
    return dataclasses.replace(params, structured_outputs=dataclasses.replace(spec, reasoning=reasoning))


class ReasoningStream:
    def __init__(self, name: str, prompt_opens: bool = False):
        if name not in PARSERS:
            raise ValueError(f"reasoning parser {name!r} does not exist; allowed: {', '.join(PARSERS)}")
        # where an output that does not open <think> itself starts
        self._default = "reasoning" if name == "deepseek_r1" or prompt_opens else "content"
        self._state = "start"  # start (not known yet) | reasoning | content
        self._buffer = ""

    def feed(self, text: str, last: bool = False) -> tuple[str, str]:
        """The reasoning and the content that the next ``text`` adds; ``last``: the output ends
        with it (all that is held comes out)."""
        self._buffer += text
        reasoning = ""
        if self._state == "start":
            head = self._buffer.lstrip()
            if head.startswith(START):
                self._state, self._buffer = "reasoning", head[len(START) :]
            elif (head and not START.startswith(head)) or last:
                self._state = self._default
            else:  # whitespace, or the start of a tag: not known yet
                return "", ""
        if self._state == "reasoning":
            end = self._buffer.find(END)
            if end < 0:
                keep = 0 if last else partial_tag(self._buffer, END)
                cut = len(self._buffer) - keep
                reasoning, self._buffer = self._buffer[:cut], self._buffer[cut:]
                return reasoning, ""
            reasoning, self._buffer = self._buffer[:end], self._buffer[end + len(END) :]
            self._state = "content"
        content, self._buffer = self._buffer, ""
        return reasoning, content


def split_reasoning(name: str, text: str, prompt_opens: bool = False) -> tuple[str, str]:
    """A whole output's (reasoning, content)."""
    return ReasoningStream(name, prompt_opens).feed(text, last=True)
