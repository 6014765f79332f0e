"""Normalise chat messages, tool calls and tool definitions to the OpenAI wire shape.

Datasets store tool use in many shapes: nested OpenAI calls or flattened ``{"name", "arguments"}``
calls, arguments as dicts or JSON text, tool definitions as dicts, bare functions or JSON strings
(a ``tool_defs`` column), and Arrow struct columns that fill every absent key with ``None``.
Chat templates expect one shape, so everything is normalised here once, before rendering:

* a tool call is ``{"id", "type": "function", "function": {"name", "arguments": <JSON text>}}``;
* a tool definition is ``{"type": "function", "function": {"name", ...}}``;
* ``None``-valued keys are dropped (they are Arrow padding, not data). A genuine ``null`` argument
  inside a dict is therefore lost; store such arguments as JSON text, which is kept verbatim.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


def drop_none(value: Any) -> Any:
    """Copy ``value`` without ``None``-valued dict keys, recursively (Arrow fills absent keys with None)."""
    if isinstance(value, Mapping):
        return {k: drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [drop_none(v) for v in value]
    return value


def _load_json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{what} is a string but not valid JSON: {err}") from None


def normalize_tool_calls(tool_calls: Any, *, start: int = 0) -> list[dict]:
    """Return ``tool_calls`` in the OpenAI shape; missing ids become ``call_{start + position}``.

    ``start`` lets :func:`normalize_messages` number calls across a whole chat, so filled ids stay
    unique and deterministic (the same row always gets the same ids).
    """
    if tool_calls is None:
        return []
    if isinstance(tool_calls, str):
        tool_calls = _load_json(tool_calls, "tool_calls") if tool_calls.strip() else []
    if isinstance(tool_calls, Mapping):
        tool_calls = [tool_calls]
    if not isinstance(tool_calls, Sequence):
        raise ValueError(f"tool_calls must be a list of dicts, got {type(tool_calls).__name__}")
    out = []
    for pos, call in enumerate(tool_calls):
        if not isinstance(call, Mapping):
            raise ValueError(f"tool call {pos}: expected a dict, got {type(call).__name__}")
        call = drop_none(call)
        if call.get("type", "function") != "function":
            raise ValueError(f"tool call {pos}: unsupported type {call['type']!r} (only 'function')")
        fn = call.get("function", call)  # flattened calls carry name/arguments at the top level
        if not isinstance(fn, Mapping):
            raise ValueError(f"tool call {pos}: 'function' must be a dict, got {type(fn).__name__}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tool call {pos}: missing function name in {call!r}")
        args = fn.get("arguments", {})
        if not isinstance(args, str):
            if not isinstance(args, (Mapping, list, tuple)):
                raise ValueError(f"tool call {pos} ({name}): arguments must be a dict or JSON text, got {args!r}")
            args = json.dumps(args, ensure_ascii=False)
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            call_id = f"call_{start + pos}"
        out.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
    return out


def _normalize_tool(tool: Any, pos: int) -> dict:
    if isinstance(tool, str):
        tool = _load_json(tool, f"tool {pos}")
    if not isinstance(tool, Mapping):
        raise ValueError(f"tool {pos}: expected a dict, got {type(tool).__name__}")
    tool = drop_none(tool)
    if tool.get("type", "function") != "function":
        raise ValueError(f"tool {pos}: unsupported type {tool['type']!r} (only 'function')")
    fn = tool.get("function", tool)  # a bare function definition is wrapped
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"tool {pos}: missing function name in {tool!r}")
    fn = {k: v for k, v in fn.items() if k != "type"} if fn is tool else dict(fn)
    return {"type": "function", "function": fn}


def normalize_tools(tools: Any) -> list[dict] | None:
    """Return tool definitions in the OpenAI shape, or None when there are none.

    Accepts a list of OpenAI tools or bare functions, either of which may be JSON text, or the
    whole list as JSON text (``tool_defs``-style columns).
    """
    if tools is None:
        return None
    if isinstance(tools, str):
        if not tools.strip():
            return None
        tools = _load_json(tools, "tools")
    if isinstance(tools, Mapping):
        tools = [tools]
    if not isinstance(tools, (list, tuple)):
        raise ValueError(f"tools must be a list of tool definitions, got {type(tools).__name__}")
    out = [_normalize_tool(t, pos) for pos, t in enumerate(tools)]
    return out or None


def _join_text_parts(parts: Sequence, where: str) -> str:
    """OpenAI-style content parts ``[{"type": "text", "text": ...}, ...]`` as one string.

    Templates such as Qwen3's render non-string content as "", so a list passed on would train
    on an empty turn. Text parts are joined with "\\n", as vLLM (our inference server) and TRL
    join them, so training sees the text the served model sees. This library trains text
    models: any other part (image, audio, ...) is an error, never silently dropped.
    """
    texts = []
    for k, part in enumerate(parts):
        kind = part.get("type", "text" if "text" in part else None) if isinstance(part, Mapping) else None
        if kind != "text":
            got = f"a {kind!r} part" if kind is not None else f"{type(part).__name__} {part!r}"[:80]
            raise ValueError(f"{where}: content part {k} is {got}; only text parts are supported (text models)")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}: content part {k} has no string 'text', got {part.get('text')!r}")
        texts.append(part["text"])
    return "\n".join(texts)


def normalize_messages(messages: Any) -> list[dict]:
    """Copy and validate a chat; tool calls get the OpenAI shape and unique, deterministic ids.

    A ``tool`` message without ``tool_call_id`` answers the next unanswered call of the preceding
    assistant message, so chats whose ids were filled here stay consistent.
    """
    if isinstance(messages, Mapping) or not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty")
    out: list[dict] = []
    n_calls = 0
    pending: list[str] = []  # ids of the last assistant's calls not yet answered by a tool message
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(f"message {i}: expected a dict, got {type(msg).__name__}")
        msg = drop_none(msg)
        role = msg.get("role")
        if role not in ROLES:
            problem = "has no 'role'" if role is None else f"has unsupported role {role!r}"
            raise ValueError(f"message {i} {problem}; expected one of {', '.join(ROLES)}")
        content = msg.get("content")
        if isinstance(content, (list, tuple)):
            content = msg["content"] = _join_text_parts(content, f"message {i} ({role})")
        if content is not None and not isinstance(content, str):
            raise ValueError(f"message {i} ({role}): content must be a string or a list of parts, got {content!r}")
        if "tool_calls" in msg and role != "assistant" and msg["tool_calls"] in (None, [], ()):
            del msg["tool_calls"]  # an export that writes an empty list on every message
        if "tool_calls" in msg:
            if role != "assistant":
                raise ValueError(f"message {i} ({role}): only assistant messages may have tool_calls")
            calls = normalize_tool_calls(msg["tool_calls"], start=n_calls)
            n_calls += len(calls)
            pending = [c["id"] for c in calls]
            if calls:
                msg["tool_calls"] = calls
            else:
                del msg["tool_calls"]
        if content is None and (role != "assistant" or "tool_calls" not in msg):
            msg["content"] = ""  # an assistant that only calls tools keeps content absent
        if role == "tool":
            if "tool_call_id" not in msg and pending:
                msg["tool_call_id"] = pending[0]
            if msg.get("tool_call_id") in pending:
                pending.remove(msg["tool_call_id"])
        out.append(msg)
    return out
