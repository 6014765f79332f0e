"""Rewards on the completion's text and length, in TRL's signature (`fn(prompts, completions, **columns)`).

- `exact_match`: the completion's answer equals the row's after normalisation (case, spacing,
  punctuation, articles of answers of several words, ``$``, ``\\boxed{}``, thousands separators);
- `regex_match`: a format reward, 1.0 when a pattern matches;
- `length_penalty`: DAPO's soft over-length penalty on the sampled token count.
"""

from __future__ import annotations

import re
import string

from lit_rl.rewards.math_answers import completion_content

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
_PUNCT = str.maketrans("", "", string.punctuation.replace("-", "").replace(".", "").replace("/", ""))


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1: j]
    return None


_TEXT_COMMAND = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")


def normalize_answer(text: str) -> str:
    """Lower case, no ``$``, no thousands separators, other commas as spaces ("2,3" is "2, 3", not
    23), no punctuation but ``-``, ``/`` and a decimal point, single spaces, no trailing full stop,
    and no articles in an answer of several words (a lone "A" is a choice, not an article): "The
    answer is $1,000$." and "answer is 1000" normalise alike. LaTeX text commands keep their
    argument (``\\text{Paris}``, ``\\textbf{No}``, ``\\mathrm{east}``: models box word answers so); other
    commands keep their names (``\\frac{1}{2}`` is not "12")."""
    text = _TEXT_COMMAND.sub(r"\1", text)
    text = _THOUSANDS.sub("", text.replace("$", "").lower()).replace(",", " ")
    words = text.translate(_PUNCT).split()
    if len(words) > 1:
        words = _ARTICLES.sub(" ", " ".join(words)).split()
    return " ".join(words).rstrip(".").strip()


def extract_answer(completion: str, pattern: str | None) -> str:
    """The answer part of a completion: the last ``\\boxed{}``, else `pattern`'s first group at its
    last match, else the whole text."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    if pattern:
        matches = list(re.finditer(pattern, completion, flags=re.DOTALL))
        if matches:
            return matches[-1].group(1) if matches[-1].groups() else matches[-1].group(0)
    return completion


def exact_match(prompts, completions, answer_column: str = "answer", answer_pattern: str | None = None,
                **columns) -> list[float]:
    """1.0 when the completion's answer (`extract_answer`) equals the row's `answer_column` after
    `normalize_answer`, else 0.0. `answer_pattern` is a regex whose first group is the answer, for
    completions that end "Answer: 42" (``"Answer:\\s*(.+)"``). An answer that normalises to
    nothing matches nothing: an empty ``\\boxed{}`` is no answer."""
    if answer_column not in columns:
        raise KeyError(f"exact_match: no column {answer_column!r} (columns: {sorted(columns)})")
    return [float(_same_answer(extract_answer(completion_content(c), answer_pattern), str(gold)))
            for c, gold in zip(completions, columns[answer_column])]


def _same_answer(answer: str, gold: str) -> bool:
    """Equal after `normalize_answer`, the gold not empty: an empty gold would match empty replies."""
    normalized = normalize_answer(gold)
    return bool(normalized) and normalize_answer(answer) == normalized


exact_match.required_columns = lambda answer_column="answer", **_: [answer_column]


def regex_match(prompts, completions, pattern: str, full: bool = False, ignore_case: bool = False,
                **columns) -> list[float]:
    """1.0 when `pattern` matches the completion (anywhere, or the whole of it with `full`; `.`
    matches newlines), else 0.0: a format reward, e.g. ``"<think>.*</think>\\s*<answer>.*</answer>"``."""
    regex = re.compile(pattern, re.DOTALL | (re.IGNORECASE if ignore_case else 0))
    match = regex.fullmatch if full else regex.search
    return [float(match(completion_content(c).strip() if full else completion_content(c)) is not None) for c in completions]


def _regex_settings(pattern: str | None = None, **_) -> list[str]:
    """No columns; the pattern checked when the config is read."""
    if pattern is None:
        raise ValueError("regex_match needs kwargs: {pattern: <a regular expression>}")
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"regex_match: pattern {pattern!r} is not a regular expression ({e})") from e
    return []


regex_match.required_columns = _regex_settings


def length_penalty(prompts, completions, completion_ids, max_length: int, buffer_length: int,
                   **columns) -> list[float]:
    """DAPO's soft over-length penalty on each completion's sampled token count n: 0 while
    n <= max_length - buffer_length, then falling linearly to -1 at max_length, -1 beyond it.
    Give it a small weight beside a task reward so that long answers lose a little, not all."""
    free = max_length - buffer_length
    return [0.0 if len(ids) <= free else max(-1.0, (free - len(ids)) / buffer_length) for ids in completion_ids]


def _length_penalty_settings(max_length: int, buffer_length: int, **_) -> list[str]:
    """No columns; the settings checked when the config is read."""
    if not 0 < buffer_length <= max_length:
        raise ValueError(f"length_penalty: need 0 < buffer_length <= max_length, got buffer_length {buffer_length} "
                         f"and max_length {max_length}")
    return []


length_penalty.required_columns = _length_penalty_settings
