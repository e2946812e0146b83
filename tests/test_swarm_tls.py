"""The Swarm stack with TLS on every hop (issue 19): deploy/swarm/deploy.sh --tls on a real swarm.

The stack runs on the session's swarm of namespaced dockerds (tests/_swarm.py shared_swarm: a
manager and two workers; tests/test_swarm.py's stack is removed first); the
certificates come from the `larql-grid certs` command the overlay's header documents (plus one
client certificate of the same CA for this host); deploy.sh turns them into Swarm secrets and
merges deploy/swarm/larql-grid.tls.yaml over the stack. Every process inside verifies the servers
it calls under the grid-wide name `larql-grid`. Then, from the host:

- `larql generate --ffn https://NODE:9090 --tls-ca ca.crt --tls-server-name larql-grid` with the
  client certificate gives the tokens of a local forward pass on the same vindex (and the golden
  transformers tokens);
- a plain-HTTP request to the router's published port gets no HTTP reply;
- the router refuses a client with no certificate, or with one of another CA, in the handshake;
- the edge (nginx, TLS both sides) serves an embed row, Prometheus scrapes every task over https,
  and larql-serve answers over TLS;
- deploy.sh --tls again replaces no task; after `larql-grid certs --renew` of the FFN certificate it
  rolls the new secret out to the FFN tasks only, and the grid generates the same tokens; a broken
  renewal (a certificate that is not its key's) is rolled back by Swarm and fails deploy.sh.

Needs root and a Docker engine with the larql-* images (like tests/test_swarm.py); skipped without
them except under CI. A second swarm beside a running one: set LARQL_SWARM_PREFIX and
LARQL_SWARM_SUBNET. Every wait is bounded; the stack is removed in any case, the swarm after the
last test that shares it.
"""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from larql_edge.tools.grid.cli import main as grid_main
from tests import _docker as dk
from tests import _swarm as sw
from tests.test_tls_deploy import _swarm_certs_command

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.under_load, pytest.mark.shared_swarm,
              pytest.mark.timeout(2400)]

ROOT = Path(__file__).resolve().parents[1]
STACK = "larql"
DEPLOY = ROOT / "deploy" / "swarm" / "deploy.sh"
OVERLAY = ROOT / "deploy" / "swarm" / "larql-grid.tls.yaml"
PROMPT = "The capital of France is"
N_TOKENS = 8
GRID_NAME = "larql-grid"
SPREAD_ROLES = ("router", "ffn", "embed")
MANAGER_ROLES = ("edge", "prometheus", "serve")
# One replica of everything: what TLS changes is every hop, not the counts (those are
# tests/test_swarm.py's). Where Swarm places the tasks varies; any hop between two nodes crosses
# the overlay network, TLS inside it as on one node.
STACK_ENV = {
    "LARQL_FFN_REPLICAS": "1",
    "LARQL_ROUTER_REPLICAS": "1",
    "LARQL_HEARTBEAT_INTERVAL": "1",
    "LARQL_UPSTREAM_TIMEOUT": "10",
}


def _certs_args() -> list[str]:
    """The `larql-grid certs` line of the overlay's header, after `larql-grid certs DIR`."""
    args = _swarm_certs_command()
    assert args[0] == "DIR", args
    return args[1:]


def _ctx(ca: Path, cert: Path | None) -> ssl.SSLContext:
    c = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        c.load_cert_chain(str(cert / "tls.crt"), str(cert / "tls.key"))
    return c


def _get(url: str, ca: Path, cert: Path | None, timeout: float = 10) -> httpx.Response:
    """GET over TLS, the server verified under the grid name (no node IP is in any certificate)."""
    with httpx.Client(verify=_ctx(ca, cert), timeout=timeout) as c:
        return c.get(url, extensions={"sni_hostname": GRID_NAME})


def _no_http_reply(host: str, port: int) -> bytes:
    """What a plain-HTTP request to a TLS port gets back (b"" when the server just closes)."""
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(f"GET /v1/health HTTP/1.1\r\nhost: {host}\r\n\r\n".encode())
        try:
            return s.recv(4096)
        except (ConnectionResetError, TimeoutError):
            return b""


def _deploy(swarm: sw.Swarm, tls_dir: Path, *args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, **STACK_ENV, "LARQL_GRID_KEY": "swarm-tls-test-grid-key-51c0", "LARQL_IMAGE_TAG": dk.TAG}
    env.pop("DOCKER_HOST", None)
    r = subprocess.run(["bash", str(DEPLOY), "--manager", f"unix://{swarm.manager.sock}", "--stack", STACK,
                        "--tls", str(tls_dir), *args], capture_output=True, text=True, timeout=timeout, env=env,
                       stdin=subprocess.DEVNULL)
    if check and r.returncode != 0:
        raise AssertionError(f"deploy.sh --tls failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}\n"
                             f"{swarm.describe(STACK)}\n{_logs(swarm)}")
    return r


def _logs(swarm: sw.Swarm) -> str:
    out = []
    for svc in ("router", "embed", "ffn-a", "ffn-b", "edge", "serve", "prometheus"):
        out.append(f"--- {STACK}_{svc}\n{swarm.logs(f'{STACK}_{svc}', tail=12)[-1500:]}")
    return "\n".join(out)


def test_swarm_stack_with_tls_generates_over_mutual_tls_and_refuses_strangers(tmp_path, gemma_f16, golden):
    why = sw.problem()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but a swarm cannot be built here: {why}")
        pytest.skip(why)
    dk.require_engine()
    spread = [dk.image(r) for r in SPREAD_ROLES]
    on_manager = [dk.image(r) for r in MANAGER_ROLES]
    missing = [i for i in (*spread, *on_manager)
               if sw.sh("docker", "image", "inspect", i, check=False, timeout=30).returncode]
    if missing:
        dk.build_images()  # CI builds them before the suite; this is for a machine that did not

    # the reference: a local forward pass on the vindex the images extract, and the golden tokens
    from larql_edge.format.vindex import Vindex
    from larql_edge.model.forward import Transformer

    vx = Vindex.open(gemma_f16)
    ids = vx.load_tokenizer().encode(PROMPT).ids
    case = golden("gemma3-270m")["prompts"][0]
    assert ids == case["input_ids"]
    local = list(Transformer.local(vx).generate(ids, N_TOKENS, stop_ids=[]))
    assert local == case["greedy_ids"][:N_TOKENS]

    # certificates: the documented command, one client certificate of the same CA, another CA's
    tls_dir, other = tmp_path / "tls", tmp_path / "other"
    assert grid_main(["certs", str(tls_dir), *_certs_args(), "client"]) == 0
    assert grid_main(["certs", str(other), "client"]) == 0
    ca, client, stranger = tls_dir / "ca.crt", tls_dir / "client", other / "client"

    timings: dict[str, float] = {}
    t0 = time.monotonic()
    swarm = sw.shared_swarm(spread, on_manager)
    swarm.remove_stack(STACK)  # tests/test_swarm.py's, if its module did not get to remove it
    try:
        t1 = time.monotonic()
        r = _deploy(swarm, tls_dir, "--no-push", "--wait", "900")
        timings["deploy --tls to converged"] = time.monotonic() - t1
        assert "TLS: certificates from" in r.stderr, r.stderr[-2000:]

        # the certificates are secrets named by content, mounted as files of the role's user
        for svc in ("router", "embed", "ffn-a", "ffn-b", "serve", "edge"):
            spec = swarm.inspect_service(f"{STACK}_{svc}")["Spec"]["TaskTemplate"]["ContainerSpec"]
            files = {s["File"]["Name"]: s for s in spec["Secrets"]}
            assert {"ca.crt", "tls.crt", "tls.key"} <= set(files), svc
            assert files["tls.key"]["File"]["Mode"] == 0o400 and files["tls.key"]["File"]["UID"] == "10001", svc
            assert files["tls.crt"]["SecretName"].startswith(f"{STACK}_tls_"), files["tls.crt"]
            assert "LARQL_TLS_SERVER_NAME=larql-grid" in spec["Env"] or svc == "edge", (svc, spec["Env"])

        [router_node] = swarm.task_nodes(f"{STACK}_router")
        router = f"https://{router_node.ip}:9090"

        def full() -> dict | None:
            v = _get(router + "/v1/grid", ca, client, timeout=5).json()
            live = {sw.member_task_id(m["url"]) for m in v["members"] if m["capability"] == "ffn" and m["live"]}
            running = {t["ID"] for svc in ("ffn-a", "ffn-b") for t in swarm.tasks(f"{STACK}_{svc}")
                       if t["CurrentState"].startswith("Running")}
            ok = v["complete"] and v["embed"] >= 1 and live == running and len(running) == 2
            return v if ok and all(m["url"].startswith("https://") for m in v["members"]) else None

        t1 = time.monotonic()
        view = sw.until("the TLS grid full (all layers, the embed server, both FFN tasks; https members)", full,
                        240, 1.0, describe=lambda: swarm.describe(STACK) + "\n" + _logs(swarm))
        timings["grid full after converged"] = time.monotonic() - t1
        ffn_nodes = {n.name for svc in ("ffn-a", "ffn-b") for n in swarm.task_nodes(f"{STACK}_{svc}")}
        sw.log(f"grid view: {[m['url'] for m in view['members']]}; FFN tasks on {sorted(ffn_nodes)}")

        # the attention-only client on this host: https, the grid's CA, the grid name, a client certificate
        from tests._grid import larql

        t1 = time.monotonic()
        gen = larql("generate", "--vindex", str(gemma_f16), "--ffn", router, "--tls-ca", str(ca),
                    "--tls-server-name", GRID_NAME, "--tls-cert", str(client / "tls.crt"),
                    "--tls-key", str(client / "tls.key"), "--prompt", PROMPT, "--max-tokens", str(N_TOKENS),
                    "--json", "--timeout", "20", timeout=600)
        timings[f"larql generate {N_TOKENS} tokens over TLS"] = time.monotonic() - t1
        assert gen.returncode == 0, gen.stderr[-3000:]
        out = dk.json_line(gen.stdout)
        assert out["prompt_ids"] == ids
        assert out["generated_ids"] == local, (out, local)
        assert case["greedy_text"].startswith(out["text"]), (out["text"], case["greedy_text"])

        # no plain HTTP on the router's port: the request gets no HTTP reply
        reply = _no_http_reply(router_node.ip, 9090)
        assert not reply.startswith(b"HTTP/"), reply[:200]
        # mutual TLS: with the grid's client certificate the router answers; with none, or another
        # CA's, it refuses in the handshake
        assert _get(router + "/v1/ready", ca, client).status_code == 200
        for cert in (None, stranger):
            with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
                _get(router + "/v1/ready", ca, cert)
        # and the client refuses a grid it cannot verify: the other CA as --tls-ca
        bad = larql("generate", "--vindex", str(gemma_f16), "--ffn", router, "--tls-ca", str(other / "ca.crt"),
                    "--tls-server-name", GRID_NAME, "--tls-cert", str(client / "tls.crt"),
                    "--tls-key", str(client / "tls.key"), "--prompt", PROMPT, "--max-tokens", "1",
                    "--timeout", "5", timeout=300)
        assert bad.returncode != 0 and "Traceback" not in bad.stderr, bad.stderr[-2000:]

        # the edge (manager, :8080): TLS to this client, mutual TLS to the embed server
        edge = f"https://{swarm.manager.ip}:8080/v1/embed/9079"
        rows = [_get(edge, ca, None) for _ in range(2)]
        assert [x.status_code for x in rows] == [200, 200], rows[0].text[:500]
        assert rows[0].content == rows[1].content and len(rows[0].content) == 640 * 4
        assert not _no_http_reply(swarm.manager.ip, 8080).startswith(b"HTTP/1.1 2")
        # larql-serve (manager, :8000): TLS for anyone, the router reached over mutual TLS
        models = _get(f"https://{swarm.manager.ip}:8000/v1/models", ca, None)
        assert models.status_code == 200, models.text[:500]

        # Prometheus scrapes every task over https with its own client certificate
        want = {"larql-router": 1, "larql-embed": 1, "larql-ffn": 2, "larql-serve": 1}
        prom = f"http://{swarm.manager.ip}:9091/api/v1/targets"

        def larql_targets() -> list[dict]:
            return [t for t in httpx.get(prom, timeout=5).json()["data"]["activeTargets"]
                    if t["labels"]["job"].startswith("larql-")]

        def scraped() -> list | None:
            up: dict[str, int] = {}
            for t in (ts := larql_targets()):
                up[t["labels"]["job"]] = up.get(t["labels"]["job"], 0) + (t["health"] == "up")
            return ts if up == want else None

        targets = sw.until("prometheus scraping every task over https", scraped, 120, 2.0, describe=lambda: str(
            [(t["labels"]["job"], t["scrapeUrl"], t["health"], t["lastError"]) for t in larql_targets()]))
        assert all(t["scrapeUrl"].startswith("https://") for t in targets)

        # deploy.sh --tls again: nothing changed, no task replaced; then a renewed FFN certificate
        # (a new secret, named by content) rolls out to the FFN tasks only, and the grid still answers
        def task_ids() -> dict[str, list[str]]:
            return {svc: sorted(t["ID"] for t in swarm.tasks(svc)) for svc in swarm.services(STACK)}

        before = task_ids()
        _deploy(swarm, tls_dir, "--no-push", "--wait", "300")
        assert task_ids() == before
        old_name = swarm.inspect_service(f"{STACK}_ffn-a")["Spec"]["TaskTemplate"]["ContainerSpec"]["Secrets"]
        ffn_names = next(a for a in _certs_args() if a.startswith("ffn="))
        assert grid_main(["certs", str(tls_dir), ffn_names, "--renew"]) == 0
        t1 = time.monotonic()
        _deploy(swarm, tls_dir, "--no-push", "--wait", "600")  # returns once the updates completed
        timings["deploy.sh: renewed FFN certificate rolled out"] = time.monotonic() - t1
        for svc in ("ffn-a", "ffn-b"):
            assert swarm.inspect_service(f"{STACK}_{svc}")["UpdateStatus"]["State"] == "completed", svc
        after = task_ids()
        # the router's live FFN members are the new tasks (the old ones left the grid)
        sw.until("the grid full of the renewed FFN tasks", full, 120, 1.0,
                 describe=lambda: swarm.describe(STACK) + "\n" + _logs(swarm))
        changed = {svc.removeprefix(f"{STACK}_") for svc in after if after[svc] != before[svc]}
        assert changed == {"ffn-a", "ffn-b"}, changed
        new_name = swarm.inspect_service(f"{STACK}_ffn-a")["Spec"]["TaskTemplate"]["ContainerSpec"]["Secrets"]
        assert {x["SecretName"] for x in new_name} - {x["SecretName"] for x in old_name}, new_name
        again = larql("generate", "--vindex", str(gemma_f16), "--ffn", router, "--tls-ca", str(ca),
                      "--tls-server-name", GRID_NAME, "--tls-cert", str(client / "tls.crt"),
                      "--tls-key", str(client / "tls.key"), "--prompt", PROMPT, "--max-tokens", str(N_TOKENS),
                      "--json", "--timeout", "20", timeout=600)
        assert again.returncode == 0 and dk.json_line(again.stdout)["generated_ids"] == local, again.stderr[-3000:]

        # a renewal gone wrong (a certificate that is not its key's): the new FFN tasks cannot start,
        # Swarm rolls them back, deploy.sh fails saying so, and the grid keeps the working tasks
        import shutil

        bad = tmp_path / "tls-bad"
        shutil.copytree(tls_dir, bad)
        assert grid_main(["certs", str(other), ffn_names]) == 0
        shutil.copy(other / "ffn" / "tls.crt", bad / "ffn" / "tls.crt")
        t1 = time.monotonic()
        r = _deploy(swarm, bad, "--no-push", "--wait", "300", check=False)
        timings["deploy.sh: a broken renewal rolled back"] = time.monotonic() - t1
        assert r.returncode != 0 and "failed: rollback" in r.stderr, (r.returncode, r.stderr[-3000:])
        sw.until("both FFN services rolled back", lambda: all(
            (swarm.inspect_service(f"{STACK}_{svc}").get("UpdateStatus") or {}).get("State") == "rollback_completed"
            for svc in ("ffn-a", "ffn-b")), 240, 1.0, describe=lambda: swarm.describe(STACK))
        sw.until("the grid full after the rollback", full, 120, 1.0,
                 describe=lambda: swarm.describe(STACK) + "\n" + _logs(swarm))
        assert task_ids()[f"{STACK}_router"] == after[f"{STACK}_router"]
        timings["in all (swarm up to checks done)"] = time.monotonic() - t0
        sw.log("timings: " + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items()))
    finally:
        swarm.remove_stack(STACK)
        sw.log(f"swarm TLS test: {time.monotonic() - t0:.0f}s with the stack's removal")
