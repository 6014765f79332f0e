"""On a CPU build, lit-rl's one-device vLLM servers run their worker inside the engine core.

Why: vLLM's CPU platform swaps the single-process executor ("uni", what a one-GPU server uses)
for the multiprocessing one, so a CPU server is three interpreters (API server, engine core,
worker), each importing vLLM: about 7 s of CPU apiece on a 2-core machine, paid at every start
and restart. With `VLLM_ENABLE_V1_MULTIPROCESSING=0` the platform keeps "uni" and the worker runs
in the engine core: a start of the tiny model took 17.0-19.5 s instead of 24.5-25.0 s, with the
same completions and logprobs and the same weight reloads (2 cores, 2026-12-06). The API server
stays a process of its own: vLLM's async engine always runs its engine core in another process;
the variable only picks the executor inside it. That process is forked from the API server
rather than spawned (`vllm_main.py`): a start took 11.0-14.5 s instead of 19.5-23.6 s (2 cores,
2026-12-06; bench/server_start.py). Set `VLLM_WORKER_MULTIPROC_METHOD` to keep vLLM's own choice.

Threads: vLLM gives the worker it spawns `OMP_NUM_THREADS` from `VLLM_CPU_OMP_THREADS_BIND` (a
list of cores: that many; "nobind": nothing; "auto", the default: the cores this process may use
but one, which vLLM reserves for its scheduler), and binds them to those cores. The thread count
is set the same way here; the binding is not. Binding through `OMP_PLACES` and `OMP_PROC_BIND`
would bind the whole engine process and the API server, not a worker: the OpenMP runtime binds a
process's first thread when it loads, and every thread started later inherits that affinity. In
the test suite, where each pytest worker's servers are bound to one core, that put everything
of a server on the core its session server's worker had: the suite took 15 min 59 s with that
binding and 15 min 11 s without (one run each, 2026-12-06). To keep a server on some cores, pin the
process that starts it (`taskset`, or `OnlineEval(cpus=...)` for the evaluator's): its children
inherit the affinity.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from lit_rl.inference.server_env import FORK_ENV, START_METHOD

ONE_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"
BIND = "VLLM_CPU_OMP_THREADS_BIND"


def bound_cores(setting: str) -> list[int] | None:
    """The cores of the first rank in a `VLLM_CPU_OMP_THREADS_BIND` list ("0-3,6" or "0-31|32-63");
    None when the setting is not a list of cores."""
    cores: list[int] = []
    try:
        for item in setting.split("|")[0].split(","):
            first, _, last = item.strip().partition("-")
            cores += range(int(first), int(last or first) + 1)
    except ValueError:
        return None
    return sorted(set(cores)) or None


def worker_in_engine_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to a one-device CPU server's environment `env`: the one-process engine,
    forked from the API server unless `VLLM_WORKER_MULTIPROC_METHOD` says otherwise (vllm_main.py),
    and the worker's thread count."""
    layout = {ONE_PROCESS: "0"} if START_METHOD in env else {ONE_PROCESS: "0", FORK_ENV: "1"}
    setting = env.get(BIND, "auto")
    if setting == "nobind":
        return layout
    cores = bound_cores(setting)
    if cores is not None:
        threads = len(cores)
    else:  # "auto"
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = max(1, usable - 1)
    return {**layout, "OMP_NUM_THREADS": str(threads)}
