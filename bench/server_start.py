#!/usr/bin/env python
"""A CPU server's start and decode in lit-rl's one-process engine against vLLM's own layout.

lit-rl starts a one-device server on a CPU build with the worker inside the engine core
(`lit_rl/inference/cpu_engine.py`), the engine core forked from the API server
(`lit_rl/inference/vllm_main.py`); `VLLM_WORKER_MULTIPROC_METHOD=spawn` keeps that layout with
the engine core spawned, as vLLM's CPU platform would start it; `--distributed-executor-backend mp`
gives vLLM's own layout (API server, engine core and worker, three interpreters, spawned). The
layouts start in turn, `--rounds` times each, on the tiny model; each start is timed to its
first healthy answer, with the machine's CPU-seconds (all processes) over the same span, and then
serves the same greedy batch: its tokens per second, and whether its tokens and logprobs equal
the other layouts'.

`--launcher` adds lit-rl's layout forked by a launcher that has imported vLLM already
(`lit_rl/inference/launcher.py`, started once before the rounds: the time it took to be ready is
printed, not counted in a start).

    .venv/bin/python bench/server_start.py              # ~5 min on 2 cores
    .venv/bin/python bench/server_start.py --rounds 2 --json out.json
    .venv/bin/python bench/server_start.py --launcher --rounds 4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_busy_s  # noqa: E402
from inference import write_checkpoint  # noqa: E402

LAYOUTS = {  # name: (extra_args, env)
    "lit-rl (worker in the engine core, forked)": ([], {}),
    "the same, engine core spawned": ([], {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}),
    "vLLM's own (mp executor)": (["--distributed-executor-backend", "mp"], {}),
}
LAUNCHED = "lit-rl's, forked by a launcher"


@contextlib.contextmanager
def launcher(root: Path):
    """A vLLM launcher on `root`/launcher (yields its socket), stopped at the end."""
    from lit_rl.child_process import stop_process_group
    from lit_rl.inference.launched_server import start_launcher

    directory = root / "launcher"
    directory.mkdir(mode=0o700)
    began = time.monotonic()
    proc = start_launcher(directory)
    try:
        while not (directory / "socket").exists():
            if proc.poll() is not None:
                raise SystemExit(f"the launcher exited: {(directory / 'launcher.log').read_text()[-2000:]}")
            time.sleep(0.1)
        print(f"launcher ready (vLLM imported) after {time.monotonic() - began:.1f} s", flush=True)
        yield str(directory / "socket")
    finally:
        stop_process_group(proc, grace=10)


async def decode(server, prompts: list[list[int]], max_tokens: int):
    async with server.client() as client:
        began = time.monotonic()
        outs = await asyncio.gather(*(client.generate(p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                                      for p in prompts))
        took = time.monotonic() - began
    done = [o[0] for o in outs]
    return sum(len(o.completion_ids) for o in done) / took, [(o.completion_ids, o.logprobs) for o in done]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="starts of each layout, alternating")
    p.add_argument("--requests", type=int, default=32, help="greedy requests served after each start")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--launcher", action="store_true", help=f"add the layout \"{LAUNCHED}\"")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="lit_rl_server_start_") as tmp:  # the model and the servers' logs
        if not args.launcher:
            return run(args, Path(tmp), LAYOUTS)
        with launcher(Path(tmp)) as socket_path:
            run(args, Path(tmp), {**LAYOUTS, LAUNCHED: ([], {})}, socket_path)


def run(args, root: Path, layouts: dict, launcher_socket: str | None = None) -> None:
    from lit_rl.inference.server import VLLMServer
    from lit_rl.inference.server_env import LAUNCHER_ENV
    from lit_rl.run_dir import step_dir

    model = write_checkpoint(step_dir(root, 0), seed=0)
    prompts = [[1 + (7 * i + j) % 200 for j in range(12)] for i in range(args.requests)]
    results = {name: {"start_s": [], "cpu_s": [], "tokens_per_s": []} for name in layouts}
    outputs = {}
    for round_ in range(args.rounds):
        for layout, (name, (extra, env)) in enumerate(layouts.items()):
            server = VLLMServer(model, dtype="float32", max_model_len=512, enforce_eager=True, allowed_root=root,
                                log_path=root / f"vllm_{round_}_{layout}.log", extra_args=extra, env=env)
            if name == LAUNCHED:  # VLLMServer reads it at start
                os.environ[LAUNCHER_ENV] = launcher_socket
            cpu, began = machine_busy_s(), time.monotonic()
            try:
                with server:
                    start_s, cpu_s = time.monotonic() - began, machine_busy_s() - cpu
                    tokens_per_s, outputs[name] = asyncio.run(decode(server, prompts, args.max_tokens))
            finally:
                os.environ.pop(LAUNCHER_ENV, None)
            for key, value in (("start_s", start_s), ("cpu_s", cpu_s), ("tokens_per_s", tokens_per_s)):
                results[name][key].append(round(value, 2))
            print(f"round {round_ + 1}, {name}: start {start_s:.1f} s, {cpu_s:.1f} CPU-s, "
                  f"{tokens_per_s:.0f} tokens/s", flush=True)
    same = len({json.dumps(o) for o in outputs.values()}) == 1
    print(f"\n{'layout':44s} {'start s (median)':>17s} {'CPU-s (median)':>15s} {'tokens/s (median)':>18s}")
    for name, r in results.items():
        print(f"{name:44s} {statistics.median(r['start_s']):17.1f} {statistics.median(r['cpu_s']):15.1f} "
              f"{statistics.median(r['tokens_per_s']):18.0f}")
    print(f"same greedy tokens and logprobs in every layout: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "same_outputs": same, "cpus": os.cpu_count()}, indent=1))


if __name__ == "__main__":
    main()
