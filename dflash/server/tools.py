"""Tools: what a request's `tools` / `tool_choice` ask for, and whether this model's chat template can serve it.

A request's tools reach the chat template (transformers' apply_chat_template(tools=)), and the model's answer is
parsed for Hermes / Qwen-style `<tool_call>{json}</tool_call>` blocks (dflash.server.parsing). So tools are served
only where the template renders them and asks for that format; tool_choice "auto" (the default with tools) lets the
model choose, "none" leaves the tools out of the prompt; a call cannot be forced ("required", a named function)
without constrained decoding, which dflash does not do, so those are refused rather than left to chance.
"""

from __future__ import annotations

import json
from typing import Callable

from .parsing import TOOL_OPEN
from .protocol import ApiError, ChatRequest


def wanted(req: ChatRequest) -> bool:
    """Whether the request's tools go into the prompt and its answer is parsed for tool calls."""
    choice = req.tool_choice
    if choice is not None and not req.tools:
        raise ApiError(400, 'tool_choice: needs "tools"', "tool_choice")
    if not req.tools or choice == "none":
        return False
    if choice in (None, "auto"):
        return True
    if choice == "required" or isinstance(choice, dict):
        asked = '"required"' if choice == "required" else "a named function"
        raise ApiError(400, f"tool_choice: {asked} is not supported (a tool call cannot be forced without "
                       'constrained decoding); send "auto" or "none"', "tool_choice")
    raise ApiError(400, f'tool_choice: got {json.dumps(choice)[:60]}, expected "none" or "auto"', "tool_choice")


def check_template(render: Callable[[list | None], str], tools: list[dict]) -> str:
    """The prompt rendered with `tools` (render(tools)); refused where the template drops them or asks for calls in a
    format other than the `<tool_call>` blocks the parser reads."""
    without = render(None)
    with_tools = render(tools)
    if with_tools == without:
        raise ApiError(400, "tools: this model's chat template does not render tools", "tools")
    if TOOL_OPEN not in with_tools:
        raise ApiError(400, f"tools: this model's chat template does not ask for {TOOL_OPEN} blocks, the one "
                       "tool-call format this server parses", "tools")
    return with_tools
