"""`math_verify`: a completion's final answer against the row's answer, compared as mathematics.

"0.5", "\\frac{1}{2}" and "$\\boxed{1/2}$" are the same answer; string matching says they are not,
which is what the `math-verify` package exists for (LaTeX and plain expressions parsed to sympy,
then compared symbolically with numeric tolerance). Its per-call timeout uses `signal.alarm`,
which works only on a process's main thread, while rollouts score on an event loop off the main
thread, and a parse can take seconds on a hostile string. So the comparisons run in a small pool
of worker processes (spawned, each scoring on its main thread, so the timeout holds), a group per
submission; the pool starts on first use and ends with the process, also when it is killed
(each worker exits with its parent, as lit-rl's servers do). A worker that dies (the OOM killer,
a crash in a C extension) breaks the whole pool: the group is scored again on a fresh one.
Spawned workers import the main module again, so a script of your own that scores with it needs
``if __name__ == "__main__":`` (the `lit-rl` command has it).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from lit_rl.child_process import exit_with_parent
from lit_rl.rewards.extras import require

log = logging.getLogger(__name__)

_POOL: ProcessPoolExecutor | None = None
_WORDS = re.compile(r"[A-Za-z]+(?:\s+[A-Za-z]+)*")
_DELIMITERS = ("$", "\\boxed", "\\(", "\\[")


def _pool() -> ProcessPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ProcessPoolExecutor(max_workers=min(2, os.cpu_count() or 1),
                                    mp_context=multiprocessing.get_context("spawn"),
                                    initializer=exit_with_parent, initargs=(os.getpid(),))
        atexit.register(_POOL.shutdown, wait=False, cancel_futures=True)
    return _POOL


def _drop_pool(pool: ProcessPoolExecutor) -> None:
    """Forget a broken pool (once, however many groups it failed) so the next call starts a fresh one."""
    global _POOL
    if _POOL is pool:
        log.warning("math_verify: a scoring worker died; starting a fresh pool")
        _POOL = None
        atexit.unregister(pool.shutdown)
        pool.shutdown(wait=False, cancel_futures=True)


def completion_content(completion) -> str:
    """A completion as text: TRL's conversational form is ``[{"role": "assistant", "content": ...}]``."""
    if isinstance(completion, list):
        return "".join(str(m.get("content") or "") for m in completion if m.get("role") == "assistant")
    return str(completion)


def verify_answers(golds: list[str], answers: list[str], timeout_seconds: float | None) -> list[float | None]:
    """In a worker process: 1.0 / 0.0 per (gold, answer), None where the gold itself does not parse.
    A gold answer without ``$``, ``\\boxed``, ``\\(`` or ``\\[`` is read as inline LaTeX (datasets
    write "\\frac{3}{4}" or "x^2 + 1" bare, and math-verify reads a bare "x^2 + 1" as the number 1).
    A gold of words ("yes", "east"; one letter, a variable or a choice, stays math) is text: as
    LaTeX it is a product of symbols, and "no" would equal "on"."""
    from math_verify import parse, verify

    timeout = None if timeout_seconds is None else max(1, int(round(timeout_seconds)))
    out: list[float | None] = []
    for gold, answer in zip(golds, answers):
        if _is_words(gold):
            out.append(float(_same_text(answer, gold)))
            continue
        # bare: LaTeX, as plain text "x^2 + 1" parses as 1 (an escaped dollar, "\\$18.90", is a currency sign)
        if not any(d in gold.replace("\\$", "") for d in _DELIMITERS):
            gold = f"${gold}$"
        parsed_gold = parse(gold, parsing_timeout=timeout)
        if all(isinstance(x, str) for x in parsed_gold):  # only math-verify's text fallback: nothing parsed
            out.append(None)
            continue
        out.append(float(verify(parsed_gold, parse(answer, parsing_timeout=timeout), timeout_seconds=timeout)))
    return out


def _is_words(gold: str) -> bool:
    stripped = gold.strip()
    return len(stripped) > 1 and _WORDS.fullmatch(stripped) is not None


def _same_text(completion: str, gold: str) -> bool:
    """`exact_match`'s comparison: the last ``\\boxed{}`` (else the whole reply) equals the gold
    after `normalize_answer`."""
    from lit_rl.rewards.text import extract_answer, normalize_answer  # text imports this module

    return normalize_answer(extract_answer(completion, None)) == normalize_answer(gold)


async def math_verify(prompts, completions, answer_column: str = "answer", timeout_seconds: float = 5.0,
                      **columns) -> list[float | None]:
    """1.0 when the completion's answer as math-verify extracts it (a ``\\boxed{}`` first, else
    LaTeX or a plain expression) equals the row's `answer_column` as mathematics, else 0.0; None when the
    row's answer does not parse (TRL's `accuracy_reward` does the same). A row's answer of words
    ("yes", "north east") is compared as text, as `exact_match` does: the last ``\\boxed{}`` (else
    the whole reply) against it after `normalize_answer`. `timeout_seconds` bounds each parse and
    comparison (whole seconds, at least 1), after which the answer counts as wrong."""
    require("math_verify", "lit_rl.rewards.math_verify")
    if answer_column not in columns:
        raise KeyError(f"math_verify: no column {answer_column!r} (columns: {sorted(columns)})")
    golds = [str(g) for g in columns[answer_column]]
    answers = [completion_content(c) for c in completions]
    loop = asyncio.get_running_loop()
    pool = _pool()
    try:
        return await loop.run_in_executor(pool, verify_answers, golds, answers, timeout_seconds)
    except BrokenProcessPool:
        _drop_pool(pool)
        return await loop.run_in_executor(_pool(), verify_answers, golds, answers, timeout_seconds)


math_verify.required_columns = lambda answer_column="answer", **_: [answer_column]
math_verify.requires = "math_verify"
