"""Dataset rows to chats: prompt/completion and messages formats, tools columns, error reporting."""

import json

import pytest

from lit_rl.data.rows import RowError, chat_from_row, detect_format

FN = {"name": "f", "description": "d", "parameters": {"type": "object"}}
TOOLS = [{"type": "function", "function": FN}]


def pc(row, **kw):
    return chat_from_row(row, format="prompt_completion", **kw)


def test_prompt_completion_strings():
    assert pc({"prompt": "2+2?", "completion": "4"}) == (
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
        None,
    )


@pytest.mark.parametrize("text", ["42", '"hi"', "[1,2]", '{"a":1}', "[]", "[{\"a\": 1}]", "{not json"])
def test_non_message_json_stays_text(text):
    messages, _ = pc({"prompt": text, "completion": text})
    assert messages == [{"role": "user", "content": text}, {"role": "assistant", "content": text}]


def test_message_shaped_json_is_decoded():
    call = {"name": "f", "arguments": {"x": 1}}
    completion = json.dumps(
        [
            {"role": "assistant", "content": "a", "tool_calls": [call]},
            {"role": "tool", "content": "r"},
            {"role": "assistant", "content": "done"},
        ]
    )
    prompt = json.dumps({"role": "user", "content": "q"})
    messages, _ = pc({"prompt": prompt, "completion": completion})
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    fn = {"name": "f", "arguments": '{"x": 1}'}
    assert messages[1]["tool_calls"][0] == {"id": "call_0", "type": "function", "function": fn}
    assert messages[2]["tool_call_id"] == "call_0"


def test_prompt_completion_message_lists_and_dict():
    row = {
        "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
        "completion": {"role": "assistant", "content": "a"},
    }
    assert pc(row)[0] == row["prompt"] + [row["completion"]]


def test_tool_call_ids_unique_across_prompt_and_completion():
    call = {"name": "f", "arguments": "{}"}
    row = {
        "prompt": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "content": "r"},
        ],
        "completion": [{"role": "assistant", "tool_calls": [call]}],
    }
    messages, _ = pc(row)
    assert [messages[1]["tool_calls"][0]["id"], messages[3]["tool_calls"][0]["id"]] == ["call_0", "call_1"]


def test_messages_column_and_custom_names():
    msgs = [{"role": "user", "content": "q", "tool_calls": None}, {"role": "assistant", "content": "a"}]
    assert chat_from_row({"conv": msgs}, messages_column="conv", format="messages") == (
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        None,
    )
    decoded, _ = chat_from_row({"messages": json.dumps(msgs)}, format="messages")
    assert decoded[1] == {"role": "assistant", "content": "a"}


@pytest.mark.parametrize("cell", [TOOLS, [FN], json.dumps([FN]), [json.dumps(FN)]])
def test_tools_column_shapes(cell):
    row = {"prompt": "q", "completion": "a", "tool_defs": cell}
    assert pc(row, tools_column="tool_defs")[1] == TOOLS


def test_missing_or_empty_tools_column_is_none():
    assert pc({"prompt": "q", "completion": "a"})[1] is None
    assert pc({"prompt": "q", "completion": "a", "tools": None})[1] is None


@pytest.mark.parametrize(
    "row, fmt, column, match",
    [
        ({"messages": None}, "messages", "messages", "None"),
        ({"messages": []}, "messages", "messages", "no messages"),
        ({"messages": "hello"}, "messages", "messages", "is text"),
        ({"messages": 3}, "messages", "messages", "got int"),
        ({"messages": [{"content": "x"}]}, "messages", "messages", "no 'role'"),
        ({}, "messages", "messages", "missing"),
        ({"prompt": "q", "completion": None}, "prompt_completion", "completion", "None"),
        ({"prompt": 1.5, "completion": "a"}, "prompt_completion", "prompt", "got float"),
        ({"prompt": "q"}, "prompt_completion", "completion", "missing"),
        ({"prompt": "q", "completion": [{"role": "user", "content": "x"}]}, "prompt_completion", "completion", "no assi"),
        ({"prompt": "q", "completion": "a", "tools": "{bad"}, "prompt_completion", "tools", "not valid JSON"),
        ({"prompt": "q", "completion": "a", "tools": [{"description": "x"}]}, "prompt_completion", "tools", "name"),
    ],
)
def test_bad_cells_name_the_column(row, fmt, column, match):
    with pytest.raises(RowError, match=match) as info:
        chat_from_row(row, format=fmt)
    assert info.value.column == column
    assert f"column {column!r}" in str(info.value)


def test_unknown_format():
    with pytest.raises(ValueError, match="format"):
        chat_from_row({"prompt": "q", "completion": "a"}, format="text")


def test_detect_format():
    assert detect_format(["messages", "id"]) == "messages"
    assert detect_format(["prompt", "completion"]) == "prompt_completion"
    assert detect_format(["q", "a"], prompt_column="q", completion_column="a") == "prompt_completion"
    with pytest.raises(ValueError) as info:
        detect_format(["prompt", "text"])
    msg = str(info.value)
    assert "'messages'" in msg and "'completion'" in msg and "['prompt', 'text']" in msg
    assert "missing ['messages'] and ['completion']" in msg
