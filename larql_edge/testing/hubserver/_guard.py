"""Keep `huggingface_hub` on the local server: refuse (and record) any request to another host."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class ForeignHostBlocked(RuntimeError):
    """Raised by the guarded client for a request to a non-local host (e.g. the public Hub)."""


@contextmanager
def local_only_client(allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS) -> Iterator[list[str]]:
    """Install a `huggingface_hub` HTTP client that refuses requests to hosts outside `allowed_hosts`.

    Yields the list of blocked URLs (assert it is empty at the end of a test: some library calls swallow
    errors, e.g. huggingface_hub's agent-registry fetch). Uses the public `set_client_factory`; the client
    is otherwise the library's default one. Restores the default factory on exit.
    """
    from huggingface_hub.utils import _http as hf_http

    blocked: list[str] = []

    def guard(request: Any) -> None:
        if request.url.host not in allowed_hosts:
            blocked.append(str(request.url))
            raise ForeignHostBlocked(f"hubserver guard: refused a request to a non-local host: {request.url}")

    def factory() -> Any:
        client = hf_http.default_client_factory()
        hooks = client.event_hooks
        hooks["request"] = [*hooks.get("request", []), guard]
        client.event_hooks = hooks
        return client

    hf_http.set_client_factory(factory)
    try:
        yield blocked
    finally:
        hf_http.set_client_factory(hf_http.default_client_factory)
