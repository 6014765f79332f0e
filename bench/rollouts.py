#!/usr/bin/env python
"""Rollout throughput: lit-rl's RolloutBuffer against a bare asyncio.gather of raw requests.

One vLLM server (float32, enforce_eager, max_model_len 512, bound to 127.0.0.1) serves a
random-init copy of the built-in tiny Qwen3. Both contenders do the same workload on it:
``--tasks`` reverse-text tasks (ReverseTextEnv over examples/reverse_text/data/test.jsonl), each
``--group-size`` completions of its chat prompt, temperature 1, top_p 1, ``--max-tokens``
completion tokens at most (no ignore_eos: completions end where the model stops, so the
completion tokens actually produced are counted and reported), ``--concurrency`` samples in
flight (= concurrency / group_size requests of n=group_size).

  lit_rl      a standalone RolloutBuffer (max_staleness None, one policy version, a batch of
              ``--batch-size`` samples, tasks x group_size / batch_size batches), consumed with
              ``async for batch in buffer`` until every sample is out. Per task it renders the
              chat prompt with the template, requests the group through InferenceClient.generate,
              decodes and scores each completion (LCS reward), builds the Samples, runs the
              default filters and computes the group advantages: what a trainer gets.
  raw_gather  the ceiling: asyncio.gather of bare openai.AsyncOpenAI().completions.create calls,
              the same request the buffer sends (prompt as token ids rendered with the same
              template beforehand, n=group_size, logprobs=0, return_token_ids), bounded by a
              semaphore of concurrency / group_size requests; only the completion tokens are
              counted from each answer.

Another environment (``--contenders``, added to the two above; the same target):

  lit_rl_dataset  the lit_rl run over a DatasetEnv of the same prompts (a jsonl of the tasks' texts
                  and their reversals, written beforehand) with two reward functions: the
                  built-in exact_match (answer column) and length_penalty (weight 0.1), each
                  called once per group in TRL's signature. What the YAML-only way to bring a
                  dataset and rewards costs against the built-in environment.

Diagnostics (``--contenders``, added to the two above), the steps in between:

  client_gather  raw_gather through lit-rl's InferenceClient.generate (answers parsed into
                 Completions), nothing else.
  env_gather     env.rollout(task, ctx) of every task under the same semaphore, no buffer:
                 prompt rendering, generate, decode, reward, Samples.

The contenders alternate for ``--rounds`` rounds after ``--warmup`` warm-up rounds (the order
flips each round); medians are reported. Each run first waits (``--quiet-wait``) for a quiet
CPU, and a run during which other processes took more than ``--max-foreign`` cores is redone
(up to ``--retries`` times). CPU seconds of this process (the client side) and of the vLLM
server's process tree are recorded per run: on a 2-core machine, client CPU is taken from the
server. ``--profile`` adds one cProfile'd buffer run at the end and prints the top functions.

Target: lit-rl >= 0.9x the raw gather's completion tokens/s.

    .venv/bin/python bench/rollouts.py                  # ~2 min on 2 quiet cores (plus waits for a quiet CPU)
    .venv/bin/python bench/rollouts.py --rounds 5 --json out.json
    .venv/bin/python bench/rollouts.py --rounds 5 --contenders lit_rl,raw_gather,client_gather,env_gather
    .venv/bin/python bench/rollouts.py --tasks 8 --group-size 4 --batch-size 8 --concurrency 16 --max-tokens 16 --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    REPO, TINY_MODEL, cpu_snapshot, exit_on_sigterm, foreign_cores, report, tree_pids, wait_until_quiet,
)

TARGET = 0.9
CONTENDERS = ("lit_rl", "raw_gather")
DIAGNOSTICS = ("client_gather", "env_gather")  # --contenders: where between the two the time goes
OTHER_ENVS = ("lit_rl_dataset",)  # --contenders: the buffer over another environment, same target


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", type=int, default=64, help="tasks (prompts) per run")
    p.add_argument("--group-size", type=int, default=8, help="completions per task (n of each request)")
    p.add_argument("--batch-size", type=int, default=64, help="samples per buffer batch (a multiple of group size)")
    p.add_argument("--concurrency", type=int, default=64, help="samples in flight (requests in flight: this / group size)")
    p.add_argument("--max-tokens", type=int, default=48, help="completion tokens at most (no ignore_eos)")
    p.add_argument("--rounds", type=int, default=3, help="alternating timed rounds; medians are reported")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds of both contenders first")
    p.add_argument("--data", default=os.path.join(REPO, "examples", "reverse_text", "data", "test.jsonl"),
                   help="reverse-text chats (the first --tasks user turns are the tasks)")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--quiet-wait", type=float, default=30.0, help="seconds to wait at most for a quiet CPU before a run")
    p.add_argument("--max-foreign", type=float, default=0.25, help="redo a run during which other processes took more cores")
    p.add_argument("--retries", type=int, default=2, help="redos of a disturbed run (then it is kept, marked)")
    p.add_argument("--contenders", default=",".join(CONTENDERS),
                   help=f"comma separated, in round order; lit_rl and raw_gather are required; diagnostics: "
                        f"{', '.join(DIAGNOSTICS)}; other environments: {', '.join(OTHER_ENVS)}")
    p.add_argument("--profile", action="store_true", help="one more buffer run under cProfile; print the top functions")
    p.add_argument("--json", default=None, help="write the summary here")
    args = p.parse_args(argv)
    problems = []
    if args.batch_size % args.group_size:
        problems.append("--batch-size must be a multiple of --group-size")
    if (args.tasks * args.group_size) % args.batch_size:
        problems.append("--tasks x --group-size must be a multiple of --batch-size (whole batches)")
    if args.concurrency % args.group_size:
        problems.append("--concurrency must be a multiple of --group-size (whole groups in flight)")
    if args.rounds < 1:
        problems.append("--rounds must be >= 1")
    args.contenders = tuple(c.strip() for c in args.contenders.split(",") if c.strip())
    unknown = set(args.contenders) - set(CONTENDERS) - set(DIAGNOSTICS) - set(OTHER_ENVS)
    if unknown or not set(CONTENDERS) <= set(args.contenders) or len(set(args.contenders)) != len(args.contenders):
        problems.append(f"--contenders: lit_rl and raw_gather once each, plus any of {', '.join(DIAGNOSTICS + OTHER_ENVS)}")
    if problems:
        p.error("; ".join(problems))
    return args


def write_step_dir(root: Path) -> Path:
    """`root/weights/step_0`: the tiny Qwen3 with random weights (seed 0) + its tokenizer, STABLE."""
    from transformers import AutoTokenizer

    from lit_rl.modules.model_loading import load_causal_lm
    from lit_rl.run_dir import STABLE, step_dir

    path = step_dir(root, 0)
    path.mkdir(parents=True, exist_ok=True)
    load_causal_lm(TINY_MODEL, random_init=True, seed=0).save_pretrained(path)
    AutoTokenizer.from_pretrained(TINY_MODEL).save_pretrained(path)
    (path / STABLE).touch()
    return path


class Bench:
    def __init__(self, args, server, model_dir: Path):
        import openai
        from transformers import AutoTokenizer

        from lit_rl.inference.client import chat_prompt_ids
        from lit_rl.rollouts import DatasetEnv, ReverseTextEnv

        self.args, self.server = args, server
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.env = ReverseTextEnv(args.data, num_examples=args.tasks)
        tasks = self.env.tasks()  # loaded once here; the env caches them for every buffer run
        if len(tasks) < args.tasks:
            raise SystemExit(f"--data {args.data} has {len(tasks)} chats; --tasks {args.tasks} needs as many")
        self.prompts = [chat_prompt_ids(self.tokenizer, self.env.prompt(t)) for t in tasks]
        if "lit_rl_dataset" in args.contenders:  # the same prompts as rows of a jsonl
            rows = model_dir.parent.parent / "dataset_env.jsonl"
            rows.write_text("".join(json.dumps({"prompt": t["text"], "answer": t["text"][::-1]}) + "\n" for t in tasks))
            self.dataset_env = DatasetEnv(str(rows), rewards=[
                "lit_rl.rewards.exact_match",
                {"function": "lit_rl.rewards.length_penalty", "weight": 0.1,
                 "kwargs": {"max_length": args.max_tokens, "buffer_length": max(1, args.max_tokens // 4)}}])
            if [self.dataset_env.prompt(t) for t in self.dataset_env.tasks()] != [self.env.prompt(t) for t in tasks]:
                raise RuntimeError("the DatasetEnv's prompts differ from ReverseTextEnv's: not the same workload")
        # One client per contender for the whole benchmark (as a trainer keeps one): the warm-up
        # round opens their connection pools and fetches the model name.
        self.client = server.client(tokenizer=self.tokenizer)
        self.raw = openai.AsyncOpenAI(base_url=server.base_url, api_key="EMPTY")
        self.model: str | None = None

    async def lit_rl(self, env=None) -> dict:
        from lit_rl.rollouts.buffer import RolloutBuffer
        from lit_rl.rollouts.context import TrainSampling

        a = self.args
        buffer = RolloutBuffer(
            env or self.env, self.client, self.tokenizer, TrainSampling(max_tokens=a.max_tokens, temperature=1.0, top_p=1.0),
            batch_size=a.batch_size, group_size=a.group_size, max_concurrency=a.concurrency, max_staleness=None,
            num_batches=a.tasks * a.group_size // a.batch_size,
        )
        samples = batches = 0
        t = time.perf_counter()
        async with buffer:  # the client is ours: the buffer does not close it
            async for batch in buffer:
                samples += len(batch)
                batches += 1
        elapsed = time.perf_counter() - t
        if buffer.counters["failed"] or buffer.counters["retries"]:
            raise RuntimeError(f"lit_rl run had failures: {buffer.counters}")
        return {"elapsed_s": elapsed, "samples": samples, "batches": batches,
                "completion_tokens": buffer.counters["completion_tokens"]}

    async def lit_rl_dataset(self) -> dict:
        """The lit_rl run over the DatasetEnv of the same prompts with two reward functions."""
        return await self.lit_rl(self.dataset_env)

    async def raw_gather(self) -> dict:
        a = self.args
        if self.model is None:
            self.model = (await self.raw.models.list()).data[0].id
        sem = asyncio.Semaphore(a.concurrency // a.group_size)

        async def one(prompt: list[int]) -> tuple[int, int]:
            async with sem:
                r = await self.raw.completions.create(
                    model=self.model, prompt=prompt, n=a.group_size, max_tokens=a.max_tokens, temperature=1.0,
                    top_p=1.0, logprobs=0, extra_body={"return_token_ids": True},
                )
            return len(r.choices), sum(len(c.model_extra["token_ids"]) for c in r.choices)

        t = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in self.prompts))
        elapsed = time.perf_counter() - t
        return {"elapsed_s": elapsed, "samples": sum(n for n, _ in results),
                "completion_tokens": sum(k for _, k in results)}

    async def _gather(self, one) -> dict:
        sem = asyncio.Semaphore(self.args.concurrency // self.args.group_size)

        async def bounded(i: int) -> tuple[int, int]:
            async with sem:
                return await one(i)

        t = time.perf_counter()
        results = await asyncio.gather(*(bounded(i) for i in range(len(self.prompts))))
        elapsed = time.perf_counter() - t
        return {"elapsed_s": elapsed, "samples": sum(n for n, _ in results), "completion_tokens": sum(k for _, k in results)}

    async def client_gather(self) -> dict:
        """Diagnostic: raw_gather through lit-rl's InferenceClient.generate (answers parsed into
        Completions), nothing else: the client's share."""
        a = self.args

        async def one(i: int) -> tuple[int, int]:
            outs = await self.client.generate(self.prompts[i], n=a.group_size, max_tokens=a.max_tokens,
                                              temperature=1.0, top_p=1.0)
            return len(outs), sum(len(c.completion_ids) for c in outs)

        return await self._gather(one)

    async def env_gather(self) -> dict:
        """Diagnostic: `env.rollout(task, ctx)` of every task under the same semaphore, no buffer:
        the environment's share (render the prompt, generate, decode, score, build the Samples)."""
        from lit_rl.rollouts.context import RolloutContext, TrainSampling

        a = self.args
        ctx = RolloutContext(client=self.client, tokenizer=self.tokenizer, group_size=a.group_size, policy_version=0,
                             sampling=TrainSampling(max_tokens=a.max_tokens, temperature=1.0, top_p=1.0))
        tasks = self.env.tasks()

        async def one(i: int) -> tuple[int, int]:
            group = await self.env.rollout(tasks[i], ctx)
            return len(group.samples), sum(s.num_targets for s in group.samples)

        return await self._gather(one)

    async def timed(self, name: str) -> dict:
        """One run with CPU accounting: this process, the server's tree, other processes."""
        server_pids = tree_pids(self.server.proc.pid)
        all_pids = tree_pids()
        cpu0, ours0, server0 = time.process_time(), cpu_snapshot(all_pids), cpu_snapshot(server_pids)
        result = await getattr(self, name)()
        cpu1, ours1, server1 = time.process_time(), cpu_snapshot(all_pids), cpu_snapshot(server_pids)
        elapsed = result["elapsed_s"]
        expected = self.args.tasks * self.args.group_size
        if result["samples"] != expected:
            raise RuntimeError(f"{name}: {result['samples']} samples, expected {expected}")
        result.update(
            samples_per_s=result["samples"] / elapsed,
            tokens_per_s=result["completion_tokens"] / elapsed,
            client_cpu_s=cpu1 - cpu0,
            server_cpu_s=None if server0 is None else server1[1] - server0[1],
            foreign_cores=foreign_cores(ours0, ours1, elapsed),
        )
        return result

    async def aclose(self) -> None:
        await self.client.aclose()
        await self.raw.close()


def run_one(bench: Bench, loop: asyncio.AbstractEventLoop, name: str, label: str, retries: int) -> dict:
    """One timed run, redone (up to `retries` times) while other processes disturb it; a run still
    disturbed after that is kept, marked ``disturbed`` (the summary leaves it out of the medians)."""
    args = bench.args
    result = None
    for attempt in range(retries + 1):
        waited = wait_until_quiet(args.quiet_wait)
        result = loop.run_until_complete(bench.timed(name))
        busy = result["foreign_cores"]
        disturbed = busy is not None and busy > args.max_foreign
        print(f"{label} {name:10s} {result['samples_per_s']:7.1f} samples/s {result['tokens_per_s']:7.0f} completion tok/s "
              f"({result['completion_tokens']} tokens in {result['elapsed_s']:.2f} s; client CPU {result['client_cpu_s']:.2f} s, "
              f"server CPU {result['server_cpu_s'] or 0:.2f} s; waited {waited:.0f} s; other processes "
              f"{'?' if busy is None else f'{busy:.2f}'} cores{'; DISTURBED' if disturbed else ''}"
              f"{', redo' if disturbed and attempt < retries else ''})",
              file=sys.stderr, flush=True)
        result["attempts"] = attempt + 1
        result["disturbed"] = disturbed
        if not disturbed:
            break
    return result


def profile_buffer(bench: Bench, loop: asyncio.AbstractEventLoop, top: int = 30) -> str:
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    result = loop.run_until_complete(bench.timed("lit_rl"))
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    print(f"profiled lit_rl run: {result['tokens_per_s']:.0f} tok/s (slowed by the profiler), "
          f"client CPU {result['client_cpu_s']:.2f} s in {result['elapsed_s']:.2f} s", file=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def summarize(args, runs: dict[str, list[dict]], wall: float, startup_s: float) -> dict:
    """Medians over the undisturbed runs (over all of a contender's runs if every one was disturbed);
    per-round ratios over the rounds where neither run was disturbed."""
    med = {}
    for name, all_runs in runs.items():
        rs = [r for r in all_runs if not r["disturbed"]] or all_runs
        med[name] = {k: statistics.median(r[k] for r in rs) for k in
                     ("samples_per_s", "tokens_per_s", "completion_tokens", "elapsed_s", "client_cpu_s")}
        servers = [r["server_cpu_s"] for r in rs if r["server_cpu_s"] is not None]
        med[name]["server_cpu_s"] = statistics.median(servers) if servers else None
        med[name]["runs_in_median"] = len(rs)
    for m in med.values():
        m["tokens_per_s_vs_raw"] = m["tokens_per_s"] / med["raw_gather"]["tokens_per_s"]
    ratio = med["lit_rl"]["tokens_per_s"] / med["raw_gather"]["tokens_per_s"]
    per_round = [lit["tokens_per_s"] / raw["tokens_per_s"] for lit, raw in zip(runs["lit_rl"], runs["raw_gather"])
                 if not lit["disturbed"] and not raw["disturbed"]]
    return {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "args": vars(args),
        "server_startup_s": startup_s,
        "wall_s": wall,
        "runs": runs,
        "median": med,
        "ratio_tokens_per_s": ratio,
        "ratio_samples_per_s": med["lit_rl"]["samples_per_s"] / med["raw_gather"]["samples_per_s"],
        "per_round_ratios": per_round,
        "median_per_round_ratio": statistics.median(per_round) if per_round else None,
        "target": {"name": f"lit-rl >= {TARGET}x raw gather tok/s", "ratio": ratio, "met": ratio >= TARGET},
        "other_targets": {name: {"name": f"{name} >= {TARGET}x raw gather tok/s", "ratio": med[name]["tokens_per_s_vs_raw"],
                                 "met": med[name]["tokens_per_s_vs_raw"] >= TARGET} for name in OTHER_ENVS if name in med},
    }


def markdown(s: dict) -> str:
    a = s["args"]
    lines = [
        f"{a['tasks']} tasks x {a['group_size']} completions, max_tokens {a['max_tokens']}, temperature 1, "
        f"{a['concurrency']} samples in flight; {a['rounds']} rounds after {a['warmup']} warm-up; "
        f"server start {s['server_startup_s']:.0f} s, total {s['wall_s']:.0f} s",
        "",
        "| contender | samples/s (median) | completion tok/s (median) | vs raw | runs (tok/s) | completion tokens/run | "
        "client CPU s/run | server CPU s/run | other procs' cores |",
        "|---|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for name, rs in s["runs"].items():
        m = s["median"][name]
        fc = ", ".join("?" if r["foreign_cores"] is None else f"{r['foreign_cores']:.2f}" for r in rs)
        server = "?" if m["server_cpu_s"] is None else f"{m['server_cpu_s']:.1f}"
        each = ", ".join(f"{r['tokens_per_s']:.0f}{'*' if r['disturbed'] else ''}" for r in rs)
        lines.append(
            f"| {name} | {m['samples_per_s']:.1f} | {m['tokens_per_s']:.0f} | {m['tokens_per_s_vs_raw']:.2f}x | {each} | {m['completion_tokens']:.0f} | "
            f"{m['client_cpu_s']:.2f} | {server} | {fc} |"
        )
    if any(r["disturbed"] for rs in s["runs"].values() for r in rs):
        lines += ["", f"\\* disturbed: other processes took more than {a['max_foreign']} cores in every one of its "
                      f"{a['retries'] + 1} attempts; left out of the medians and the per-round ratios"]
    lines += [
        "",
        f"lit-rl / raw gather: {s['ratio_tokens_per_s']:.3f}x completion tok/s, {s['ratio_samples_per_s']:.3f}x samples/s "
        f"(per-round tok/s ratios: {', '.join(f'{x:.3f}' for x in s['per_round_ratios']) or 'no undisturbed round'}"
        + (f"; their median {s['median_per_round_ratio']:.3f}x)" if s["median_per_round_ratio"] is not None else ")"),
        "",
        f"target {s['target']['name']} -> {'met' if s['target']['met'] else 'NOT met'} ({s['ratio_tokens_per_s']:.3f}x)",
    ]
    lines += [f"target {t['name']} -> {'met' if t['met'] else 'NOT met'} ({t['ratio']:.3f}x)"
              for t in s.get("other_targets", {}).values()]
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    exit_on_sigterm()
    start = time.perf_counter()
    from lit_rl.inference.server import VLLMServer

    with tempfile.TemporaryDirectory(prefix="lit-rl-bench-rollouts-") as tmp:
        root = Path(tmp)
        os.environ["HF_DATASETS_CACHE"] = str(root / "hf_datasets")  # keep Arrow caches out of ~/.cache
        model_dir = write_step_dir(root)
        server = VLLMServer(model_dir, host="127.0.0.1", dtype="float32", max_model_len=args.max_model_len,
                            enforce_eager=True, allowed_root=root, log_path=root / "vllm.log", startup_timeout=900)
        loop = asyncio.new_event_loop()
        bench = None
        try:
            server.start()
            print(f"server up after {server.startup_seconds:.1f} s", file=sys.stderr, flush=True)
            bench = Bench(args, server, model_dir)
            for w in range(args.warmup):
                for name in args.contenders:
                    run_one(bench, loop, name, f"warm-up {w + 1}/{args.warmup}", retries=0)
            runs: dict[str, list[dict]] = {name: [] for name in args.contenders}
            for r in range(args.rounds):
                for name in (args.contenders if r % 2 == 0 else args.contenders[::-1]):
                    runs[name].append(run_one(bench, loop, name, f"round {r + 1}/{args.rounds}", args.retries))
            profile = profile_buffer(bench, loop) if args.profile else None
            summary = summarize(args, runs, time.perf_counter() - start, server.startup_seconds)
        finally:
            try:
                if bench is not None:
                    loop.run_until_complete(bench.aclose())
                loop.close()
            finally:
                server.stop()  # the whole process group, whatever happened above
    if profile:
        print(profile)
    return report(summary, markdown, args.json)


if __name__ == "__main__":
    main()
