"""The roles as in-process servers for the fast tier: real HTTP on loopback from threads of the test
process (`larql_edge.testing.servers.ServerThread`), wired the way each role's CLI wires them."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

from larql_edge.format.layers import LayerRange
from larql_edge.service.membership import GridSettings, install_membership
from larql_edge.testing.servers import ServerThread
from larql_edge.tools.grid.supervisor import free_port
from tests._grid import GRID_KEY


def grid_settings(router_urls: str | Sequence[str], port: int, key: str = GRID_KEY) -> GridSettings:
    routers = (router_urls,) if isinstance(router_urls, str) else tuple(router_urls)
    return GridSettings(routers=routers, grid_key=key, public_url=f"http://127.0.0.1:{port}")


def router(heartbeat: float = 0.25, evict_after: float | None = None, key: str = GRID_KEY, static_ffn=(), static_embed=(),
           **limits) -> ServerThread:
    from larql_edge.roles.router.app import Limits, create_app
    from larql_edge.roles.router.registry import Registry

    reg = Registry(heartbeat_interval=heartbeat, evict_after=evict_after)
    for rng, url in static_ffn:
        reg.add_static("ffn", url, LayerRange.parse(rng) if rng else None)
    for url in static_embed:
        reg.add_static("embed", url)
    return ServerThread(create_app(reg, key, Limits(**limits)))


def shard(vindex: Path, layers: str | None, join: str | Sequence[str] | None = None, key: str = GRID_KEY,
          **limits) -> ServerThread:
    from larql_edge.roles.ffn.app import create_app
    from larql_edge.roles.ffn.shard import Limits, Shard

    s = Shard(vindex, LayerRange.parse(layers) if layers else None, limits=Limits(**limits))
    app = create_app(s)
    port = free_port()
    if join:
        install_membership(app, grid_settings(join, port, key), "ffn", lambda: s.describe(app.ctx.compute.inflight))
    return ServerThread(app, port=port)


def embed(models: dict[str, Path], join: str | Sequence[str] | None = None, key: str = GRID_KEY, lm_head_cache: Path | None = None,
          hot_cache: int = 64, **limits) -> ServerThread:
    import dataclasses

    from larql_edge.roles.embed.app import create_app
    from larql_edge.roles.embed.config import EmbedConfig, Limits, ModelSource

    port = free_port()
    cfg = EmbedConfig(models=tuple(ModelSource(id=k, path=str(Path(v).resolve())) for k, v in models.items()),
                      port=port, hot_cache=hot_cache, lm_head_cache=str(lm_head_cache) if lm_head_cache else None,
                      limits=dataclasses.replace(Limits(), **limits))
    if join:
        cfg = dataclasses.replace(cfg, grid=grid_settings(join, port, key))
    return ServerThread(create_app(cfg), port=port)


def wait_ready(*servers: ServerThread, timeout: float = 60.0) -> None:
    import time

    import httpx

    deadline = time.monotonic() + timeout
    for s in servers:
        while True:
            try:
                if httpx.get(s.url + "/v1/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{s.app.name} not ready after {timeout}s")
            time.sleep(0.05)


@contextmanager
def grid(vindex: Path, ranges: Sequence[str], *, replicas: int = 1, embed_vindex: Path | None = None,
         timeout: float = 60.0) -> Iterator[dict]:
    """Router + embed server + shards (each range ``replicas`` times), joined and complete."""
    from tests._grid import wait_grid

    with ExitStack() as stack:
        # Heartbeats every 0.25 s, eviction only after 10 s without one: on two loaded cores (or beside
        # another pytest worker) a member's heartbeat can be a second late, and these grids serve whole
        # modules of tests that are not about eviction (test_router_registry and test_router_faults are).
        r = stack.enter_context(router(evict_after=10.0))
        e = stack.enter_context(embed({"m": embed_vindex or vindex}, join=r.url))
        shards = {rng: [stack.enter_context(shard(vindex, rng, join=r.url)) for _ in range(replicas)] for rng in ranges}
        wait_ready(e, timeout=timeout)
        wait_grid(r.url, embed=1, timeout=timeout)
        yield {"router": r, "embed": e, "shards": shards}
