"""Where a config's inference server is: one lit-rl starts, or an existing one at a `base_url`.

Every config that takes a server follows one rule (`open_endpoint`): with `base_url`, use that
server and start nothing; otherwise start a `VLLMServer` and wait until it is healthy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lit_rl.inference.server import VLLMServer


@dataclass
class Endpoint:
    """Where the inference server is: one lit-rl started (`server` set) or an existing one (`base_url`)."""

    base_url: str
    api_key: str | None = None
    allowed_root: str | Path | None = None
    server: VLLMServer | None = None

    def client(self, **kwargs):
        from lit_rl.inference.client import InferenceClient

        if self.server is not None:
            return self.server.client(**kwargs)
        kwargs.setdefault("api_key", self.api_key)
        kwargs.setdefault("allowed_root", self.allowed_root)
        return InferenceClient(self.base_url, **kwargs)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def open_endpoint(
    *,
    base_url: str | None = None,
    model: str | Path | None = None,
    api_key: str | None = None,
    allowed_root: str | Path | None = None,
    interrupt: Callable[[], bool] | None = None,
    **server_kwargs,
) -> Endpoint:
    """The rule for every config that takes a server: with `base_url`, use that server and start
    nothing; otherwise start `VLLMServer(model, **server_kwargs)` and wait until it is healthy
    (`interrupt` as in `VLLMServer.start`)."""
    if base_url:
        if server_kwargs:
            raise ValueError(f"base_url={base_url!r} is an existing server; these server options have no effect: {sorted(server_kwargs)}")
        return Endpoint(base_url=base_url, api_key=api_key, allowed_root=allowed_root)
    if model is None:
        raise ValueError("give either base_url (an existing server) or model (lit-rl starts a vLLM server for it)")
    server = VLLMServer(model, api_key=api_key, allowed_root=allowed_root, **server_kwargs).start(interrupt)
    return Endpoint(base_url=server.base_url, api_key=api_key, allowed_root=allowed_root, server=server)
