"""Shared by the benchmarks in bench/: deterministic synthetic chats and CPU accounting.

The built-in tiny tokenizer (lit_rl/assets/tiny_qwen3) is byte-level with no merges: one
ASCII character is one token. A one-turn chat rendered with its template costs a fixed
scaffold of `SCAFFOLD_TOKENS` tokens (``<|im_start|>user\\n`` ... ``<|im_end|>\\n``), so a
chat of exactly N rendered tokens has N - SCAFFOLD_TOKENS characters of content, split at
random between the user turn and the assistant turn. The assistant body plus its
``<|im_end|>`` are the trained tokens.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_MODEL = os.path.join(REPO, "lit_rl", "assets", "tiny_qwen3")

# <|im_start|> user \n ... <|im_end|> \n <|im_start|> assistant \n ... <|im_end|> \n
SCAFFOLD_TOKENS = 1 + 5 + 0 + 1 + 1 + 1 + 10 + 0 + 1 + 1

_WORDS = (
    "the of and to in is was for on that with as by at from his her they this had not are but were "
    "apple river stone light music green table water cloud bread tiger ocean number reverse sort list "
    "answer question city north south east west small large quick brown fox jumps over lazy dog"
).split()


#: the checkpoints `bash examples/reverse_text/run_opd_demo.sh` makes, the benches' defaults: the SFT
#: demo stopped at step 40 (the weak student) and the whole SFT demo (the teacher)
STUDENT = "runs/reverse_text_sft_short/weights/step_40"
TEACHER = "runs/reverse_text_sft/weights/step_300"


def require_checkpoint(parser, flag: str, path: str, demo: str = "run_opd_demo.sh", makes: str = "it") -> None:
    """Exit through `parser.error` unless `path` is a finished checkpoint (marked STABLE), naming
    the demo script that makes it."""
    if not os.path.isfile(os.path.join(path, "STABLE")):
        parser.error(f"{flag} {path} is not a finished checkpoint; bash examples/reverse_text/{demo} makes {makes}")


def _text_pool(seed: int, size: int = 1 << 16) -> str:
    rng = random.Random(seed)
    words, length = [], 0
    while length < size:
        w = rng.choice(_WORDS)
        words.append(w)
        length += len(w) + 1
    return " ".join(words)


def make_chats(n: int, *, seed: int = 0, min_tokens: int = 24, max_tokens: int = 120, answer_share: float | None = None):
    """Yield `n` one-turn chats ({"messages": [user, assistant]}), each exactly `min_tokens`..`max_tokens`
    tokens long once rendered with the tiny model's chat template (length uniform in that range).
    The content splits between the turns at random, or with `answer_share` of it in the answer
    (so that a fixed fraction of the tokens is trained, e.g. 0.4)."""
    if answer_share is not None and not 0.0 < answer_share < 1.0:
        raise ValueError(f"answer_share must be in (0, 1), got {answer_share}")
    if min_tokens < SCAFFOLD_TOKENS + 2:
        raise ValueError(f"min_tokens must be >= {SCAFFOLD_TOKENS + 2} (the template scaffold plus one character a turn)")
    rng = random.Random(seed)
    pool = _text_pool(seed)
    span = len(pool) - max_tokens
    for _ in range(n):
        body = rng.randint(min_tokens, max_tokens) - SCAFFOLD_TOKENS
        user_len = rng.randint(1, body - 1)
        if answer_share is not None:
            user_len = min(max(1, round(body * (1.0 - answer_share))), body - 1)
        a, b = rng.randrange(span), rng.randrange(span)
        user = pool[a : a + user_len]
        answer = pool[b : b + body - user_len]
        yield {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so `finally:` blocks still remove the benchmark's temp files."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def write_chats_jsonl(path: str, n: int, **kwargs) -> str:
    with open(path, "w") as f:
        for row in make_chats(n, **kwargs):
            f.write(json.dumps(row) + "\n")
    return path


# ---- CPU accounting: the benchmark machine is shared ------------------------------------------------
_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_busy_s() -> float | None:
    """CPU seconds the whole machine has been busy (all cores, idle and iowait excluded), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:  # not Linux
        return None
    return (sum(fields) - fields[3] - fields[4]) / _HZ


def resident_gb() -> float | None:
    """This process's resident set now, in GB (10^9 bytes), from /proc/self/statm (None off Linux).
    Unlike ru_maxrss (the peak), it tells what a run holds between its peaks."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except OSError:
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 1e9


def tree_pids(root: int | None = None) -> list[int]:
    """root (default: this process) and its live descendants (e.g. DataLoader workers), from /proc."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def cpu_snapshot(pids: list[int] | None = None) -> tuple[float, float] | None:
    """(CPU seconds busy on the whole machine, CPU seconds used by this process and its live children).

    Over a window, the first minus the second is what other processes took: with torch on every
    core, a foreign process running at the same time slows a step down a lot. `pids` (from
    `tree_pids()`) skips the walk over /proc when the process tree is known not to change.
    """
    busy = machine_busy_s()
    if busy is None:
        return None
    ours = 0
    for pid in pids if pids is not None else tree_pids():
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
            ours += int(stat[11]) + int(stat[12])  # utime + stime
        except (OSError, IndexError, ValueError):
            continue
    return busy, ours / _HZ


def foreign_cores(before, after, elapsed: float) -> float | None:
    """Average number of cores other processes kept busy between two snapshots."""
    if before is None or after is None or elapsed <= 0:
        return None
    return max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / elapsed


def wait_until_quiet(max_wait: float, threshold: float = 0.25, window: float = 1.0) -> float:
    """Wait (at most max_wait s) until other processes use < threshold cores; returns seconds waited."""
    start = time.perf_counter()
    while time.perf_counter() - start < max_wait:
        before = cpu_snapshot()
        time.sleep(window)
        load = foreign_cores(before, cpu_snapshot(), window)
        if load is None or load < threshold:
            break
    return time.perf_counter() - start


def report(summary: dict, markdown, json_path: str | None) -> dict:
    """Print a benchmark's JSON summary and its markdown table; also write the JSON if asked."""
    print(json.dumps(summary, indent=2))
    print()
    print(markdown(summary))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(summary, f, indent=2)
    return summary
