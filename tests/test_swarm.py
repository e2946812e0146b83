"""The grid as a Docker Swarm stack (deploy/swarm/larql-grid.yaml) on a real 3-node swarm.

tests/_swarm.py builds the swarm: three dockerds, each in a network namespace of its own, joined by
veth pairs (a manager and two workers). The images come from the host engine (built by
docker/build-images.sh); deploy/swarm/deploy.sh deploys the stack. Then, with the attention-only
client running on the host (the way a user far from the grid runs it) against every router's
host-mode published port:

- the stack converges: FFN replicas of a layer range on different nodes, the grid key only as a
  Swarm secret file, Prometheus finding every task by DNS; a second deploy.sh run changes nothing;
- the golden prompt gives the golden tokens through the grid; the edge cache serves embed rows;
- a worker's link is cut in the middle of a generation: it completes, with the same tokens;
- a router is partitioned from a node: that node's members are evicted, and rejoin after healing;
- a rolling update of a shard service under running generations never leaves a layer uncovered;
  an update to a broken image rolls back by itself;
- one of two routers is killed mid-generation: the generation completes on the other;
- the larql-serve front door answers an OpenAI completion with the golden text.

Needs root (namespaces, extra dockerds) and a Docker engine; skipped without them except under CI
(env CI set), where that fails. Every wait is bounded; the swarm is torn down in any case.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests import _docker as dk
from tests import _swarm as sw

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.under_load, pytest.mark.shared_swarm,
              pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[1]
STACK = "larql"
STACK_FILE = ROOT / "deploy" / "swarm" / "larql-grid.yaml"
DEPLOY = ROOT / "deploy" / "swarm" / "deploy.sh"
PROMPT = "The capital of France is"
GRID_KEY = "swarm-test-grid-key-7d1e93b04c"
FFN_SERVICES = (f"{STACK}_ffn-a", f"{STACK}_ffn-b")
FFN_REPLICAS = 2
ROUTER = f"{STACK}_router"
EMBED = f"{STACK}_embed"
# Images every node may run (spread services) and those only the manager runs (placed on managers).
SPREAD_ROLES = ("router", "ffn", "embed")
MANAGER_ROLES = ("edge", "prometheus", "serve")
# Short heartbeats and update monitors keep the fault tests quick; the stack's defaults are for
# real deployments (2 s heartbeat, 15 s monitor).
STACK_ENV = {
    "LARQL_HEARTBEAT_INTERVAL": "1",
    "LARQL_UPDATE_MONITOR": "8s",
    "LARQL_ROLLBACK_MONITOR": "5s",
    "LARQL_UPDATE_DELAY": "1s",
    "LARQL_UPSTREAM_TIMEOUT": "5",
}
CLIENT_TIMEOUT_S = 8.0  # one reply; a silent router costs this much before the client fails over
CLIENT_RETRIES = 8


def log(msg: str) -> None:
    sw.log(msg)


# ---- the swarm and the grid on it -----------------------------------------------------------

class Grid:
    def __init__(self, swarm: sw.Swarm, features: dict, vindex: Path, reference: dict, timings: dict):
        self.swarm, self.features, self.vindex, self.reference, self.timings = swarm, features, vindex, reference, timings

    @property
    def manager(self) -> sw.Node:
        return self.swarm.manager

    def routers(self) -> list[str]:
        """Every router's published URL, the manager's first (clients list them all)."""
        nodes = sorted(self.swarm.task_nodes(ROUTER), key=lambda n: n.index)
        return [f"http://{n.ip}:9090" for n in nodes]

    def views(self) -> dict[str, dict]:
        return {u: sw.grid_view(u) for u in self.routers()}

    def full(self) -> bool:
        """Converged, and every router sees every layer, the embed server and every FFN task."""
        if not self.swarm.converged(STACK):
            return False
        urls = self.routers()
        if len(urls) != self.features["routers"]:
            return False
        running = {t["ID"] for svc in FFN_SERVICES for t in self.swarm.tasks(svc)}
        for u in urls:
            v = sw.grid_view(u)
            live = {sw.member_task_id(m["url"]) for m in v["members"] if m["capability"] == "ffn" and m["live"]}
            if not (v["complete"] and v["embed"] >= 1 and live == running and len(running) == 2 * FFN_REPLICAS):
                return False
        return True

    def wait_full(self, timeout: float = 240) -> None:
        sw.until("grid full (every router: all layers, the embed server, every FFN task)", self.full, timeout, 1.0,
                 describe=self.describe)

    def describe(self) -> str:
        out = [self.swarm.describe(STACK)]
        with contextlib.suppress(Exception):
            for u, v in self.views().items():
                out.append(f"{u}: complete={v['complete']} gaps={v['gaps']} embed={v['embed']} members="
                           + ", ".join(f"{m['url']}({'live' if m['live'] else 'dead'})" for m in v["members"]))
        return "\n".join(out)

    def client(self, urls: list[str] | None = None):
        """The attention-only client (the project's own), on this host, listing every router."""
        from larql_edge.format.vindex import Vindex
        from larql_edge.roles.client._build import build_remote
        from tests._grid import remote_args

        args = remote_args(ffn=",".join(urls or self.routers()), timeout=CLIENT_TIMEOUT_S, retries=CLIENT_RETRIES)
        return build_remote(Vindex.open(self.vindex), args)

    def generate(self, n: int, on_token=None, urls: list[str] | None = None) -> list[int]:
        model = self.client(urls)
        out: list[int] = []
        for t in model.generate(self.reference["prompt_ids"], n, stop_ids=[]):
            out.append(t)
            if on_token is not None:
                on_token(len(out))
        return out


def _probe_features(swarm: sw.Swarm) -> dict:
    """What the images can do, asked of the images themselves (on the manager node)."""
    def help_of(role: str, exe: str) -> str:
        r = swarm.manager.docker("run", "--rm", "--network", "none", "--entrypoint", exe, dk.image(role), "--help",
                                 check=False, timeout=120)
        return " ".join((r.stdout + r.stderr).split())

    ffn = help_of("ffn", "larql-ffn")
    return {
        "grid_key_file": "LARQL_GRID_KEY_FILE" in ffn or "--grid-key-file" in ffn,
        "multi_router": any("comma-separated" in part[:200] for part in ffn.split("--join")[1:]),
        "serve": sw.sh("docker", "image", "inspect", dk.image("serve"), check=False, timeout=30).returncode == 0,
    }


def deploy_sh(swarm: sw.Swarm, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, **STACK_ENV, "LARQL_GRID_KEY": GRID_KEY, "LARQL_IMAGE_TAG": dk.TAG,
           "LARQL_FFN_REPLICAS": str(FFN_REPLICAS)}
    env.pop("DOCKER_HOST", None)
    r = subprocess.run(["bash", str(DEPLOY), "--manager", f"unix://{swarm.manager.sock}", "--stack", STACK, *args],
                       capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise AssertionError(f"deploy.sh failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}\n"
                             f"{swarm.describe(STACK)}")
    return r


@pytest.fixture(scope="module")
def reference(gemma_f16):
    """The local forward pass on the f16 vindex the images extract: the tokens to compare with."""
    from larql_edge.format.vindex import Vindex
    from larql_edge.model.forward import Transformer

    vx = Vindex.open(gemma_f16)
    tok = vx.load_tokenizer()
    ids = tok.encode(PROMPT).ids
    greedy = list(Transformer.local(vx).generate(ids, 32, stop_ids=[]))
    return {"prompt_ids": ids, "greedy32": greedy, "tokenizer": tok}


@pytest.fixture(scope="module")
def grid(gemma_f16, reference, golden):
    why = sw.problem()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but a swarm cannot be built here: {why}")
        pytest.skip(why)
    dk.require_engine()
    assert reference["prompt_ids"] == golden("gemma3-270m")["prompts"][0]["input_ids"]
    spread = [dk.image(r) for r in SPREAD_ROLES]
    on_manager = [dk.image(r) for r in MANAGER_ROLES
                  if sw.sh("docker", "image", "inspect", dk.image(r), check=False, timeout=30).returncode == 0]
    if any(sw.sh("docker", "image", "inspect", i, check=False, timeout=30).returncode for i in spread):
        dk.build_images()  # CI builds them before the suite; this is for a machine that did not
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    # How the images reach the nodes. "load" (default): docker save | docker load into every node
    # before the deploy, measured ~3x faster here than a registry. "registry": the path a user
    # takes, deploy.sh pushing to a registry the nodes pull from when tasks land on them.
    method = os.environ.get("LARQL_SWARM_IMAGES", "load")
    if method not in ("load", "registry"):
        pytest.fail(f"LARQL_SWARM_IMAGES must be load or registry, not {method!r}")
    # "load" runs on the session's shared swarm (tests/test_swarm_tls.py deploys its stack there
    # next); "registry" on a swarm of its own whose nodes pull.
    swarm = sw.Swarm(3, offline=False) if method == "registry" else None
    try:
        if swarm is not None:
            swarm.up()
        else:
            swarm = sw.shared_swarm(spread, on_manager)
            swarm.remove_stack(STACK)  # one an interrupted earlier module left
        if method == "registry":
            push_addr, pull_addr = swarm._ensure_registry()
            # the feature probe below runs an image on the manager: it needs one there first
            swarm._via_registry([dk.image("ffn")], [swarm.manager])
            deploy_args = ["--registry", pull_addr, "--push-registry", push_addr]
        else:
            deploy_args = ["--no-push"]
        features = _probe_features(swarm)
        log(f"image features: {features}")
        assert features["grid_key_file"] and features["multi_router"], (
            f"{dk.image('ffn')} predates the interfaces the stack is built on (LARQL_GRID_KEY_FILE, --join "
            f"resolving to every router): rebuild the images (docker/build-images.sh); features {features}")
        features["routers"] = 2  # the stack's default (LARQL_ROUTER_REPLICAS)
        t1 = time.monotonic()
        deploy_sh(swarm, *deploy_args, "--wait", "1200")
        timings["deploy to converged" + (" (nodes pulling from the registry)" if method == "registry" else "")] = \
            time.monotonic() - t1
        g = Grid(swarm, features, gemma_f16, reference, timings)
        g.deploy_args = deploy_args
        g.wait_full(240)
        timings["swarm up + images + deploy"] = time.monotonic() - t0
        timings.update(swarm.timings)
        log("timings: " + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items()))
        yield g
    finally:
        if method == "registry":
            if swarm is not None:
                swarm.down()
        elif swarm is not None:
            swarm.remove_stack(STACK)
        log(f"swarm test module: {time.monotonic() - t0:.0f}s in all")
        host_state = sw.sh("docker", "info", "--format", "{{.Swarm.LocalNodeState}}", timeout=60).stdout.strip()
        assert host_state == "inactive", f"the host engine must stay outside any swarm (it is {host_state!r})"


@pytest.fixture
def full_grid(grid):
    """Each test starts from a full grid and leaves no fault behind."""
    grid.wait_full()
    try:
        yield grid
    finally:
        grid.swarm.heal_all()


# ---- the stack -----------------------------------------------------------------------------------

def test_stack_converges_spread_and_keeps_the_key_a_file(full_grid):
    g, s = full_grid, full_grid.swarm
    for svc in FFN_SERVICES:
        nodes = [n.name for n in s.task_nodes(svc)]
        assert len(nodes) == FFN_REPLICAS and len(set(nodes)) == FFN_REPLICAS, (svc, nodes)
    assert len(set(n.name for n in s.task_nodes(ROUTER))) == len(g.routers())
    for svc in s.services(STACK):
        spec = s.inspect_service(svc)["Spec"]
        text = s.manager.docker("service", "inspect", svc).stdout
        assert GRID_KEY not in text, svc  # the key is in no spec, env or label
        env = spec["TaskTemplate"]["ContainerSpec"].get("Env", [])
        assert not any(e.startswith("LARQL_GRID_KEY=") for e in env), (svc, env)
        if svc.endswith(("_router", "_embed", "_ffn-a", "_ffn-b")):
            assert "LARQL_GRID_KEY_FILE=/run/secrets/grid_key" in env, svc
            secrets = spec["TaskTemplate"]["ContainerSpec"]["Secrets"]
            assert [x["File"]["Name"] for x in secrets] == ["grid_key"], svc
        upd = spec.get("UpdateConfig", {})
        assert upd.get("Order") == "start-first" and upd.get("FailureAction") == "rollback", (svc, upd)
        assert spec.get("RollbackConfig", {}).get("Order") == "start-first", svc
        assert spec["EndpointSpec"]["Mode"] == "dnsrr", svc
    for u, v in g.views().items():
        assert GRID_KEY not in str(v)
        assert v["complete"] and v["gaps"] == [] and v["num_layers"] == 18, (u, v["coverage"])
        assert {c["replicas"] for c in v["coverage"]} == {FFN_REPLICAS}, v["coverage"]
    for svc in (ROUTER, EMBED, *FFN_SERVICES):
        assert GRID_KEY not in s.logs(svc, tail=200), svc
    # the secret is a file in the task, readable by the role's user (10001) only
    node, cid = s.containers(ROUTER)[0]
    out = node.docker("exec", cid, "sh", "-c", "stat -c '%a %u' /run/secrets/grid_key; cat /run/secrets/grid_key").stdout
    assert out.split("\n")[0] == "400 10001" and GRID_KEY in out

    # deploy.sh again: idempotent (the secret is kept, no task is replaced)
    before = {svc: sorted(t["ID"] for t in s.tasks(svc)) for svc in s.services(STACK)}
    r = deploy_sh(s, *g.deploy_args, "--wait", "120")
    assert "larql_grid_key exists: kept" in r.stderr
    after = {svc: sorted(t["ID"] for t in s.tasks(svc)) for svc in s.services(STACK)}
    assert after == before


def test_prometheus_finds_every_task_by_dns(full_grid):
    g, s = full_grid, full_grid.swarm
    want = {"larql-router": len(s.tasks(ROUTER)), "larql-embed": len(s.tasks(EMBED)),
            "larql-ffn": sum(len(s.tasks(svc)) for svc in FFN_SERVICES)}
    url = f"http://{g.manager.ip}:9091/api/v1/targets"

    def up_counts() -> dict | None:
        targets = httpx.get(url, timeout=5).json()["data"]["activeTargets"]
        counts: dict[str, int] = {}
        for t in targets:
            if t["health"] == "up":
                counts[t["labels"]["job"]] = counts.get(t["labels"]["job"], 0) + 1
        return counts if all(counts.get(j, 0) == n for j, n in want.items()) else None

    counts = sw.until("prometheus scraping every task", up_counts, 90, 2.0)
    assert counts["larql-ffn"] == 2 * FFN_REPLICAS
    layers = {t["labels"].get("layers") for t in httpx.get(url, timeout=5).json()["data"]["activeTargets"]
              if t["labels"]["job"] == "larql-ffn"}
    assert layers == {"0-8", "9-17"}


def test_golden_prompt_through_the_swarm_grid_and_the_edge(full_grid, golden):
    """`larql generate` on this host, with every router's published URL: the golden 16 tokens."""
    g = full_grid
    case = golden("gemma3-270m")["prompts"][0]
    from tests._grid import larql

    r = larql("generate", "--vindex", str(g.vindex), "--ffn", ",".join(g.routers()), "--prompt", PROMPT,
              "--max-tokens", "16", "--json", "--timeout", str(CLIENT_TIMEOUT_S), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = dk.json_line(r.stdout)
    assert out["prompt_ids"] == case["input_ids"]
    assert out["generated_ids"] == case["greedy_ids"] == g.reference["greedy32"][:16]
    assert out["text"] == case["greedy_text"]

    # the edge cache on the manager: the same row as the embed server sends, a HIT the second time
    edge = f"http://{g.manager.ip}:8080/v1/embed/9079"
    via_router = httpx.get(f"{g.routers()[0]}/v1/embed/9079", timeout=10)
    first = httpx.get(edge, timeout=10)
    second = httpx.get(edge, timeout=10)
    assert first.status_code == second.status_code == via_router.status_code == 200
    assert first.content == second.content == via_router.content and len(first.content) == 640 * 4
    assert second.headers.get("x-cache") == "HIT"


def test_serve_front_door_answers_with_the_golden_text(full_grid, golden):
    """larql-serve (port 8000 on the manager), OpenAI completions, greedy: the golden text."""
    g = full_grid
    assert g.features["serve"], (f"no {dk.image('serve')} image on the host engine: the larql-serve role and "
                                 "image are the lead's work in progress (the stack scales serve to 0 without it)")
    case = golden("gemma3-270m")["prompts"][0]
    base = f"http://{g.manager.ip}:8000"
    sw.until("serve ready", lambda: httpx.get(base + "/v1/ready", timeout=3).status_code == 200, 120, 1.0)
    r = httpx.post(base + "/v1/completions", timeout=120,
                   json={"model": "gemma3-270m", "prompt": PROMPT, "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text[:2000]
    assert r.json()["choices"][0]["text"] == case["greedy_text"]


# ---- faults -----------------------------------------------------------------------------------

def _worker_without(g: Grid, *services: str) -> sw.Node:
    """A worker that runs FFN tasks but none of ``services`` (single points we do not test here)."""
    avoid = {n.name for svc in services for n in g.swarm.task_nodes(svc)}
    ffn_nodes = {n.name for svc in FFN_SERVICES for n in g.swarm.task_nodes(svc)}
    for w in g.swarm.workers:
        if w.name in ffn_nodes and w.name not in avoid:
            return w
    pytest.fail(f"no worker runs FFN tasks without {services}:\n{g.describe()}")


def test_cut_worker_link_mid_generation_completes_on_the_other_replicas(full_grid):
    g, s = full_grid, full_grid.swarm
    worker = _worker_without(g, EMBED)
    cut_at = 3

    def on_token(i: int) -> None:
        if i == cut_at:
            s.cut_link(worker)

    t0 = time.monotonic()
    try:
        out = g.generate(32, on_token)
    finally:
        s.restore_link(worker)
    log(f"generation across the cut: {time.monotonic() - t0:.1f}s")
    assert out == g.reference["greedy32"]
    g.wait_full(300)  # the worker's members rejoin (or Swarm replaced them elsewhere)


def test_partition_router_from_a_node_evicts_its_members_then_they_rejoin(full_grid):
    g, s = full_grid, full_grid.swarm
    ffn_nodes = {n.name for svc in FFN_SERVICES for n in s.task_nodes(svc)}
    embed_nodes = {n.name for n in s.task_nodes(EMBED)}
    # A router and a node of FFN replicas (not the embed server's) other than the router's own. Which pair
    # exists depends on where Swarm put the tasks: the link cut before this test may have moved a
    # worker's tasks to the other nodes, so every router is tried.
    pairs = [(url, node, n) for url in g.routers() for node in [s.node(url.split("//")[1].split(":")[0])]
             for n in s.nodes if n is not node and n.name in ffn_nodes and n.name not in embed_nodes]
    assert pairs, g.describe()
    router_url, router_node, target = pairs[0]
    where = sw.task_nodes_by_id(s, STACK)
    victims = {tid for tid, n in where.items() if n is target
               and any(tid in {t["ID"] for t in s.tasks(svc)} for svc in FFN_SERVICES)}
    assert victims

    def live_ids() -> set[str]:
        return {sw.member_task_id(m["url"]) for m in sw.grid_view(router_url)["members"] if m["live"]}

    s.partition(router_node, target)
    try:
        sw.until(f"{router_url} evicts the members on {target.name}", lambda: not (live_ids() & victims), 30, 0.25,
                 describe=g.describe)
        view = sw.grid_view(router_url)
        assert view["complete"], view  # the other replicas cover every layer
        # generation still works through that router (the evicted members are not tried)
        assert g.generate(6, urls=[router_url]) == g.reference["greedy32"][:6]
    finally:
        s.heal(router_node, target)
    sw.until(f"the members on {target.name} rejoin {router_url}", lambda: victims <= live_ids(), 120, 0.25,
             describe=g.describe)
    assert set(t["ID"] for svc in FFN_SERVICES for t in s.tasks(svc)) >= victims  # the same tasks: rejoined


class CoverageWatch:
    """Polls every router's /v1/grid a few times a second; records every moment a layer is unserved."""

    def __init__(self, g: Grid, timeout: float = 10.0):
        self.g = g
        self.timeout = timeout
        self.samples = 0
        self.per_url: dict[str, int] = {}
        self.min_replicas: dict[str, int] = {}  # fewest live replicas seen per coverage run (layers -> n)
        self.gaps: list[str] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "CoverageWatch":
        self.urls = self.g.routers()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        with httpx.Client(timeout=self.timeout) as c:
            while not self._stop.is_set():
                for u in self.urls:
                    try:
                        v = c.get(u + "/v1/grid").json()
                    except (httpx.HTTPError, ValueError) as e:
                        self.errors.append(f"{time.strftime('%H:%M:%S')} {u}: {type(e).__name__} {e}")
                        continue
                    self.samples += 1
                    self.per_url[u] = self.per_url.get(u, 0) + 1
                    for run in v["coverage"]:
                        k = run["layers"]
                        self.min_replicas[k] = min(self.min_replicas.get(k, run["replicas"]), run["replicas"])
                    if not v["complete"]:
                        self.gaps.append(f"{time.strftime('%H:%M:%S')} {u}: gaps {v['gaps']}")
                self._stop.wait(0.25)


def _update_state(s: sw.Swarm, service: str) -> str:
    return (s.inspect_service(service).get("UpdateStatus") or {}).get("State", "")


def _generate_until(g: Grid, done, limit_s: float) -> tuple[int, list[str]]:
    """Generations back to back until ``done()`` (bounded); returns (count, mismatches)."""
    deadline = time.monotonic() + limit_s
    count, bad = 0, []
    while not done():
        assert time.monotonic() < deadline, f"update not finished after {limit_s:.0f}s:\n{g.describe()}"
        out = g.generate(8)
        count += 1
        if out != g.reference["greedy32"][:8]:
            bad.append(str(out))
    return count, bad


def test_rolling_update_of_a_shard_never_leaves_a_layer_uncovered(full_grid):
    g, s = full_grid, full_grid.swarm
    svc = FFN_SERVICES[0]
    current = s.inspect_service(svc)["Spec"]["TaskTemplate"]["ContainerSpec"]["Image"]
    # the same content under a new name: a new release to Swarm
    new_image = s.tag_everywhere(current, f"larql-ffn:{dk.TAG}-rolling")
    old_tasks = {t["ID"] for t in s.tasks(svc)}
    with CoverageWatch(g) as watch:
        s.manager.docker("service", "update", "--detach", "--no-resolve-image", "--image", new_image, svc)
        sw.until("update started", lambda: _update_state(s, svc) != "", 30, 0.2)
        count, bad = _generate_until(g, lambda: _update_state(s, svc) not in ("updating", ""), 600)
    assert _update_state(s, svc) == "completed", g.describe()
    assert watch.samples > 20 and watch.gaps == [], watch.gaps[:10]
    assert count >= 1 and bad == [], bad
    tasks = s.tasks(svc)
    assert len(tasks) == FFN_REPLICAS and not ({t["ID"] for t in tasks} & old_tasks)
    assert all(t["Image"] == new_image for t in tasks), tasks
    log(f"rolling update: {count} generations, {watch.samples} coverage samples, no gap")


def test_update_to_a_broken_image_rolls_back_by_itself(full_grid):
    g, s = full_grid, full_grid.swarm
    svc = FFN_SERVICES[1]
    before = s.inspect_service(svc)["Spec"]["TaskTemplate"]["ContainerSpec"]["Image"]
    # the shard's image with a process that dies at once: what a bad release looks like to Swarm
    broken = s.build_everywhere(f"larql-ffn:{dk.TAG}-broken",
                                f"FROM {before}\nENTRYPOINT [\"sh\", \"-c\", \"echo broken release >&2; exit 3\"]\n",
                                base=before)
    old_tasks = {t["ID"] for t in s.tasks(svc)}
    with CoverageWatch(g) as watch:
        s.manager.docker("service", "update", "--detach", "--no-resolve-image", "--image", broken, svc)
        sw.until("update started", lambda: _update_state(s, svc) != "", 30, 0.2)
        terminal = ("rollback_completed", "rollback_paused", "paused", "completed")
        count, bad = _generate_until(g, lambda: _update_state(s, svc) in terminal, 300)
    assert _update_state(s, svc) == "rollback_completed", g.describe()
    spec_image = s.inspect_service(svc)["Spec"]["TaskTemplate"]["ContainerSpec"]["Image"]
    assert spec_image == before
    g.wait_full(120)
    assert {t["ID"] for t in s.tasks(svc)} == old_tasks  # start-first: the old tasks never stopped
    assert watch.gaps == [] and bad == [], (watch.gaps[:10], bad)


class Streams:
    """Four generations at a time, back to back, until stopped: two with the attention-only client
    (this host, every router's URL), two streamed by larql-serve (OpenAI completions, SSE; serve on the
    manager reaches the routers by their dnsrr name). Every one must give the reference text; any
    exception, error event, missing [DONE] or other text is a failed generation."""

    def __init__(self, g: Grid, case: dict, n: int = 4):
        self.g, self.case = g, case
        self.serve = f"http://{g.manager.ip}:8000" if g.features["serve"] else None
        kinds = ["larql", "serve"] * (n // 2) if self.serve else ["larql"] * n
        self.ok = {i: 0 for i in range(n)}
        self.failed: list[str] = []
        self.kinds = kinds
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i, k), daemon=True) for i, k in enumerate(kinds)]

    def _one_larql(self, model) -> None:
        out = list(model.generate(self.g.reference["prompt_ids"], 8, stop_ids=[]))
        if out != self.g.reference["greedy32"][:8]:
            raise AssertionError(f"tokens {out}")

    def _one_serve(self, c: httpx.Client) -> None:
        text, done = "", False
        body = {"model": "gemma3-270m", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stream": True}
        with c.stream("POST", self.serve + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise AssertionError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    raise AssertionError(f"error event {obj['error']}")
                text += "".join(ch.get("text", "") for ch in obj.get("choices", []))
        if not done or text != self.case["greedy_text"]:
            raise AssertionError(f"[DONE] {done}, text {text!r}")

    def _run(self, i: int, kind: str) -> None:
        with httpx.Client(timeout=httpx.Timeout(120, connect=10)) as c:
            model = self.g.client() if kind == "larql" else None
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    self._one_larql(model) if kind == "larql" else self._one_serve(c)
                    self.ok[i] += 1
                except Exception as e:  # noqa: BLE001 - every failure is counted and reported
                    self.failed.append(f"{time.strftime('%H:%M:%S')} stream {i} ({kind}, {time.monotonic() - t0:.1f}s): "
                                       f"{type(e).__name__}: {str(e)[:300]}")

    def __enter__(self) -> "Streams":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(300)


@pytest.mark.under_load(hogs=2)
def test_rolling_update_of_every_ffn_service_under_load_keeps_every_range_and_generation(full_grid, golden):
    """Issue 19's rolling update: `docker service update --force` of every FFN service, one after the
    other, with two CPU hogs running and four streams generating: no failed generation, and no layer
    range uncovered in any sample of either router. What keeps a range covered: start-first updates;
    the old task, on SIGTERM, stays in the routers until its successor has joined them
    (LARQL_HANDOVER_SECONDS), then leaves and drains within stop_grace_period; and the router does
    not count its own stalls on a starved host as members' silence."""
    g, s = full_grid, full_grid.swarm
    case = golden("gemma3-270m")["prompts"][0]
    if g.features["serve"]:
        base = f"http://{g.manager.ip}:8000"
        sw.until("serve ready", lambda: httpx.get(base + "/v1/ready", timeout=3).status_code == 200, 120, 1.0)
    t0 = time.monotonic()
    replaced: dict[str, float] = {}
    terminal = ("completed", "paused", "rollback_completed", "rollback_paused")
    with CoverageWatch(g) as watch, Streams(g, case) as streams:
        sw.until("every stream generated once", lambda: all(streams.ok.values()) or streams.failed, 600, 0.5)
        before = sum(streams.ok.values())
        for svc in FFN_SERVICES:
            t1 = time.monotonic()
            old_tasks = {t["ID"] for t in s.tasks(svc)}
            s.manager.docker("service", "update", "--detach", "--force", svc)
            sw.until(f"{svc} update started", lambda svc=svc: _update_state(s, svc) != "", 30, 0.2)
            sw.until(f"{svc} update finished", lambda svc=svc: _update_state(s, svc) in terminal, 900, 1.0,
                     describe=g.describe)
            assert _update_state(s, svc) == "completed", g.describe()
            tasks = s.tasks(svc)
            assert len(tasks) == FFN_REPLICAS and not ({t["ID"] for t in tasks} & old_tasks), g.describe()
            replaced[svc] = time.monotonic() - t1
        during = sum(streams.ok.values()) - before
    elapsed = time.monotonic() - t0
    per_router = {u: watch.per_url.get(u, 0) for u in watch.urls}
    log(f"rolling update of {', '.join(FFN_SERVICES)} beside 2 CPU hogs: {elapsed:.0f}s "
        f"({', '.join(f'{k} {v:.0f}s' for k, v in replaced.items())}); generations {sum(streams.ok.values())} "
        f"({during} during the updates; per stream {streams.ok}, kinds {streams.kinds}), failed "
        f"{len(streams.failed)}; coverage samples {watch.samples} {per_router}, gaps {len(watch.gaps)}, "
        f"poll errors {len(watch.errors)}, fewest live replicas of a range {watch.min_replicas}")
    assert streams.failed == [], streams.failed[:10]
    assert watch.gaps == [], watch.gaps[:10]
    assert watch.errors == [], watch.errors[:10]
    assert all(n >= 20 for n in per_router.values()), per_router
    assert during >= len(streams.kinds), (during, streams.ok)  # the streams ran through the updates
    g.wait_full(120)


def test_kill_one_of_two_routers_mid_generation(full_grid):
    g, s = full_grid, full_grid.swarm
    urls = g.routers()
    assert len(urls) == 2, ("two routers need members that join every router behind one name "
                            f"(LARQL_JOIN=http://router:9090, dnsrr): the images do not (features {g.features})")
    first = s.node(urls[0].split("//")[1].split(":")[0])  # the client's preferred router: the first URL
    kill_at = 3

    def on_token(i: int) -> None:
        if i == kill_at:
            s.kill_task(ROUTER, first)

    out = g.generate(32, on_token, urls=urls)
    assert out == g.reference["greedy32"]
    # Swarm starts a new router task; the members learn it by resolving `router` again
    g.wait_full(180)


# ---- deploy.sh on its own ------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--bogus"], "unknown argument: --bogus"),
    (["--wait", "soon"], "--wait must be a number of seconds"),
    (["--roles", "router gpu"], "unknown role 'gpu'"),
    (["--manager", "unix:///nonexistent/docker.sock"], "no Docker engine at unix:///nonexistent/docker.sock"),
    # the host engine stays outside any swarm (tests/_swarm.py never makes it join one)
    ([], "is not a swarm manager"),
])
def test_deploy_sh_says_what_is_wrong(args, message):
    dk.require_engine()
    env = {k: v for k, v in os.environ.items() if k != "DOCKER_HOST"}
    r = subprocess.run(["bash", str(DEPLOY), *args], capture_output=True, text=True, timeout=60, env=env,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and message in r.stderr, r.stderr
    assert r.stderr.count("\n") <= 3, r.stderr  # a line, not the usage text
