"""Turn a dataset row into a chat (messages plus tool definitions) ready for rendering.

Two row formats are supported: a ``messages`` column holding a whole chat, or ``prompt`` and
``completion`` columns, each a string, a message or a list of messages (TRL's conventions). A
string prompt is a user turn and a string completion an assistant turn. Strings are decoded from
JSON only when they are message-shaped, so a completion such as ``"42"`` or ``"[1, 2]"`` stays
text. Every bad cell raises :class:`RowError` naming its column, so a data error points at the data.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from lit_rl.data.tools import normalize_messages, normalize_tools

FORMATS = ("messages", "prompt_completion")


class RowError(ValueError):
    """A dataset cell cannot be turned into chat messages; ``column`` names the cell's column.

    ``str(err)`` reads ``column 'x': <message>``; ``message`` is the bare problem.
    """

    def __init__(self, column: str, message: str):
        super().__init__(f"column {column!r}: {message}")
        self.column, self.message = column, message


def _is_message(value) -> bool:
    return isinstance(value, Mapping) and "role" in value


def _message_json(text: str):
    """The decoded messages if ``text`` is a JSON message or list of messages, else None."""
    stripped = text.strip()
    if not stripped.startswith(("{", "[")):
        return None
    try:
        value = json.loads(stripped)
    except json.JSONDecodeError:
        return None
    if _is_message(value):
        return [value]
    if isinstance(value, list) and value and all(_is_message(v) for v in value):
        return value
    return None


def _cell_messages(row: Mapping, column: str, text_role: str | None) -> list[dict]:
    """Raw, validated messages of one cell; plain text becomes one ``text_role`` message if allowed."""
    if column not in row:
        raise RowError(column, f"missing from the row (columns: {sorted(row)})")
    cell = row[column]
    if cell is None:
        raise RowError(column, "is empty (None)")
    if isinstance(cell, str):
        decoded = _message_json(cell)
        if decoded is not None:
            cell = decoded
        elif text_role is not None:
            return [{"role": text_role, "content": cell}]
        else:
            raise RowError(column, "is text, expected a list of messages")
    if isinstance(cell, Mapping):
        cell = [cell]
    if not isinstance(cell, (list, tuple)):
        raise RowError(column, f"expected a string or a list of messages, got {type(cell).__name__}")
    if not cell:
        raise RowError(column, "has no messages")
    try:
        normalize_messages(cell)  # validate here so the error names this column
    except ValueError as err:
        raise RowError(column, str(err)) from None
    return list(cell)  # normalised by the caller, so filled tool-call ids are unique per chat


def chat_from_row(
    row: Mapping,
    *,
    messages_column: str = "messages",
    prompt_column: str = "prompt",
    completion_column: str = "completion",
    tools_column: str = "tools",
    format: str,
) -> tuple[list[dict], list[dict] | None]:
    """Return ``(messages, tools)`` for ``row``; ``tools`` is None when the row has none."""
    if format == "messages":
        messages = normalize_messages(_cell_messages(row, messages_column, None))
    elif format == "prompt_completion":
        prompt = _cell_messages(row, prompt_column, "user")
        completion = _cell_messages(row, completion_column, "assistant")
        if not any(m["role"] == "assistant" for m in completion):
            raise RowError(completion_column, "has no assistant message")
        messages = normalize_messages(prompt + completion)
    else:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    try:
        tools = normalize_tools(row.get(tools_column))
    except ValueError as err:
        raise RowError(tools_column, str(err)) from None
    return messages, tools


def completion_start(row: Mapping, *, prompt_column: str = "prompt", format: str, **_columns) -> int:
    """Index of the first completion message: assistant turns before it (few-shot examples
    inside a prompt) are context, not targets. 0 for the messages format: every turn trains."""
    if format != "prompt_completion":
        return 0
    return len(_cell_messages(row, prompt_column, "user"))


def detect_format(
    column_names: Iterable[str],
    messages_column: str = "messages",
    prompt_column: str = "prompt",
    completion_column: str = "completion",
) -> str:
    """Return ``"messages"`` or ``"prompt_completion"`` from a dataset's column names."""
    names = list(column_names)
    if messages_column in names:
        return "messages"
    if prompt_column in names and completion_column in names:
        return "prompt_completion"
    missing = [c for c in (prompt_column, completion_column) if c not in names]
    raise ValueError(
        f"cannot tell the dataset format: expected a {messages_column!r} column, or {prompt_column!r} and "
        f"{completion_column!r} columns; missing {[messages_column]} and {missing}; found columns {names}"
    )
