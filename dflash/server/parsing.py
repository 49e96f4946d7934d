"""Splitting a streamed answer into reasoning, content and tool calls, as text arrives.

A thinking model writes `<think>...</think>` before its answer (or its chat template opens the `<think>` in the
prompt); Qwen / Hermes-style tool calls are `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.
The parser never emits a partial tag: text that may be the start of one is held until the next piece decides.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from ..core.output import held_back

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


def starts_in_reasoning(prompt_text: str) -> bool:
    """True when the chat template left a `<think>` open at the end of the prompt (the model continues inside it)."""
    return prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)


class OutputParser:
    def __init__(self, reasoning: bool = False, in_reasoning: bool = False, tools: bool = False):
        self.reasoning, self.tools = reasoning, tools
        self.mode = "reasoning" if reasoning and in_reasoning else "content"
        self.buffer = ""
        self.content_started = False  # a <think> is recognised only before any content
        self.after_think = False  # strip the blank lines a model writes after </think>
        self.calls: list[dict] = []
        self.after_call = False

    def _tags(self) -> list[str]:
        if self.mode == "reasoning":
            return [THINK_CLOSE]
        if self.mode == "tool":
            return [TOOL_CLOSE]
        tags = [TOOL_OPEN] if self.tools else []
        if self.reasoning and not self.content_started:
            tags.append(THINK_OPEN)
        return tags

    def feed(self, text: str, final: bool = False) -> Delta:
        out = Delta()
        self.buffer += text
        while True:
            tags = self._tags()
            hits = [(self.buffer.find(t), t) for t in tags if t in self.buffer]
            if hits:
                at, tag = min(hits)
                self._emit(out, self.buffer[:at])
                self.buffer = self.buffer[at + len(tag):]
                self._switch(out, tag)
                continue
            if self.mode == "tool":  # a call is emitted whole, once closed
                if final:
                    self._emit_content(out, TOOL_OPEN + self.buffer)
                    self.buffer = ""
                return out
            keep = 0 if final else held_back(self.buffer, tags)
            self._emit(out, self.buffer[:len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep:]
            return out

    def _switch(self, out: Delta, tag: str) -> None:
        if tag == THINK_OPEN:
            self.mode = "reasoning"
        elif tag == THINK_CLOSE:
            self.mode, self.after_think = "content", True
        elif tag == TOOL_OPEN:
            self.mode = "tool"
        else:  # TOOL_CLOSE
            self.mode = "content"
            call = parse_tool_call(self.buffer_tool, len(self.calls))
            if call is None:
                self._emit_content(out, TOOL_OPEN + self.buffer_tool + TOOL_CLOSE)
            else:
                self.calls.append(call)
                out.tool_calls.append(call)
                self.after_call = True

    def _emit(self, out: Delta, text: str) -> None:
        if self.mode == "tool":
            self.buffer_tool = text
        elif self.mode == "reasoning":
            out.reasoning += text
        else:
            self._emit_content(out, text)

    def _emit_content(self, out: Delta, text: str) -> None:
        if self.after_call:  # the blank lines between and after tool calls are not content (as vLLM's parser)
            text = text.lstrip()
            if not text:
                return
            self.after_call = False
        if self.after_think or not self.content_started:
            text = text.lstrip("\n") if self.after_think else text
            if not text.strip() and self.reasoning:
                return  # blank lines before the answer (or before a <think>) are not content yet
            self.after_think = False
        if text:
            self.content_started = True
            out.content += text

    buffer_tool = ""


def parse_tool_call(body: str, index: int) -> dict | None:
    """One OpenAI tool call from a <tool_call> block's JSON, or None if it is not one."""
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}
