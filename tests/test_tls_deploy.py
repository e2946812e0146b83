"""TLS in the deployments (issue 19): `larql-grid certs`, the images' TLS-aware scripts, the compose
override (compose.tls.yaml) with the real Docker engine, and the Helm chart's TLS values rendered.

Fast tier: the certificates `larql-grid certs` makes (names, modes, reuse), the images' healthcheck
script against a real mutual-TLS server, the Prometheus TLS config kept in step with the plain one.
Slow tier: `docker compose -f compose.yaml -f compose.tls.yaml up grid` (a generation through the
grid, every larql port refusing plain HTTP, a client without a grid certificate refused), and the
Helm chart rendered with TLS on (helm template, helm lint, kubernetes-validate); no cluster runs here.
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import stat
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from larql_edge.tools.grid.cli import main as grid_main
from tests.test_tls import _TlsServer

ROOT = Path(__file__).resolve().parents[1]


def _sans(cert: Path) -> set[str]:
    from cryptography import x509

    c = x509.load_pem_x509_certificate(cert.read_bytes())
    ext = c.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(v) for v in ext.get_values_for_type(x509.DNSName)} | \
        {str(v) for v in ext.get_values_for_type(x509.IPAddress)}


# ---- larql-grid certs ----------------------------------------------------------------------------

def test_grid_certs_makes_a_ca_and_a_secret_folder_per_name(tmp_path, capsys):
    out = tmp_path / "tls"
    assert grid_main(["certs", str(out), "ffn-0=larql-ffn-0.larql-ffn,*.larql-ffn.ns.svc,10.1.2.3", "router"]) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    assert stat.S_IMODE((out / "ca.key").stat().st_mode) == 0o600
    for name in ("ffn-0", "router"):
        folder = out / name
        assert sorted(p.name for p in folder.iterdir()) == ["ca.crt", "tls.crt", "tls.key"]  # a TLS Secret's keys
        assert stat.S_IMODE((folder / "tls.key").stat().st_mode) == 0o600
        assert (folder / "ca.crt").read_bytes() == (out / "ca.crt").read_bytes()
    assert _sans(out / "ffn-0" / "tls.crt") == {"larql-ffn-0.larql-ffn", "*.larql-ffn.ns.svc", "10.1.2.3"}
    assert _sans(out / "router" / "tls.crt") == {"router"}

    # a server presenting it is verified by a client of the CA under each name, and demands the CA's clients
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(out / "router" / "tls.crt", out / "router" / "tls.key")
    server.load_verify_locations(out / "ca.crt")
    server.verify_mode = ssl.CERT_REQUIRED
    with _TlsServer(server) as srv:
        client = ssl.create_default_context(cafile=str(out / "ca.crt"))
        client.load_cert_chain(out / "ffn-0" / "tls.crt", out / "ffn-0" / "tls.key")
        client.check_hostname = False  # the name: below, with the router's own name
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as raw, \
                client.wrap_socket(raw, server_hostname="router") as s:
            assert s.version() in ("TLSv1.2", "TLSv1.3")
        client.check_hostname = True
        with pytest.raises(ssl.SSLCertVerificationError, match="match"):
            with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as raw:
                client.wrap_socket(raw, server_hostname="embed")

    # again: the CA and existing certificates are kept; --renew issues again; new names are added
    ca_before, cert_before = (out / "ca.crt").read_bytes(), (out / "router" / "tls.crt").read_bytes()
    assert grid_main(["certs", str(out), "router", "embed"]) == 0
    assert (out / "ca.crt").read_bytes() == ca_before and (out / "router" / "tls.crt").read_bytes() == cert_before
    assert (out / "embed" / "tls.crt").exists()
    assert grid_main(["certs", str(out), "router", "--renew", "--readable-keys"]) == 0
    assert (out / "router" / "tls.crt").read_bytes() != cert_before and (out / "ca.crt").read_bytes() == ca_before
    assert stat.S_IMODE((out / "router" / "tls.key").stat().st_mode) == 0o644
    assert stat.S_IMODE((out / "router").stat().st_mode) == 0o700
    assert "CA reused" in capsys.readouterr().out


def test_grid_certs_defaults_to_the_compose_services_and_refuses_bad_names(tmp_path, capsys):
    out = tmp_path / "tls"
    assert grid_main(["certs", str(out)]) == 0
    compose = yaml.safe_load((ROOT / "compose.tls.yaml").read_text())
    # every secret file compose.tls.yaml mounts is one `larql-grid certs` made
    for name, spec in compose["secrets"].items():
        assert (out / spec["file"].replace("${LARQL_TLS_DIR:-./tls}/", "")).is_file(), name
    # members announce https://<service>:<port>: their certificates cover that name
    for svc in ("embed", "ffn-a", "ffn-b"):
        url = compose["services"][svc]["environment"]["LARQL_PUBLIC_URL"]
        assert url.startswith("https://") and url.split("//")[1].split(":")[0] in _sans(out / svc / "tls.crt")
    assert {"router", "localhost", "127.0.0.1"} <= _sans(out / "router" / "tls.crt")
    capsys.readouterr()
    assert grid_main(["certs", str(out), "../escape"]) != 0
    assert "a name is letters" in capsys.readouterr().err
    assert not (tmp_path / "escape").exists()


def test_prometheus_tls_config_scrapes_the_same_jobs_over_https():
    plain = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    tls = yaml.safe_load((ROOT / "deploy/prometheus/prometheus-tls.yml").read_text())
    strip = lambda job: {k: v for k, v in job.items() if k not in ("scheme", "tls_config")}  # noqa: E731
    assert {k: v for k, v in tls.items() if k != "scrape_configs"} == \
        {k: v for k, v in plain.items() if k != "scrape_configs"}
    assert [strip(j) for j in tls["scrape_configs"]] == plain["scrape_configs"]
    for job in tls["scrape_configs"]:
        if job["job_name"].startswith("larql-"):
            assert job["scheme"] == "https"
            assert job["tls_config"] == {"ca_file": "/run/secrets/ca.crt", "cert_file": "/run/secrets/tls.crt",
                                         "key_file": "/run/secrets/tls.key"}


# ---- the images' scripts, against a real mutual-TLS server -----------------------------------------

def _healthcheck(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("LARQL_TLS")}
    return subprocess.run(["sh", str(ROOT / "docker/roles/larql-healthcheck"), *args], env={**base, **env},
                          capture_output=True, text=True, timeout=30)


@pytest.mark.multiprocess
def test_image_healthcheck_speaks_mutual_tls_when_the_server_does(tmp_path):
    """The HEALTHCHECK of every image under compose.tls.yaml / the Swarm stack / Helm exec probes: with
    the server's own LARQL_TLS_* it reaches https://127.0.0.1 (chain verified, client certificate shown);
    without a client certificate the server refuses it, so the probe really went through mutual TLS."""
    grid_main(["certs", str(tmp_path / "tls"), "router", "stranger"])
    d = tmp_path / "tls"
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(d / "router/tls.crt", d / "router/tls.key")
    server.load_verify_locations(d / "ca.crt")
    server.verify_mode = ssl.CERT_REQUIRED
    env = {"LARQL_TLS_CERT_FILE": str(d / "router/tls.crt"), "LARQL_TLS_KEY_FILE": str(d / "router/tls.key"),
           "LARQL_TLS_CA_FILE": str(d / "ca.crt")}
    with _TlsServer(server) as srv:
        env["LARQL_PORT"] = str(srv.port)
        ok = _healthcheck(env)
        assert ok.returncode == 0, ok.stderr
        ok = _healthcheck(env, "--any", f"http://127.0.0.1:{srv.port}/v1/health")  # the edge's form
        assert ok.returncode == 0, ok.stderr
        no_cert = _healthcheck({"LARQL_TLS_CERT_FILE": env["LARQL_TLS_CERT_FILE"], "LARQL_TLS_CA_FILE": env["LARQL_TLS_CA_FILE"],
                                "LARQL_PORT": env["LARQL_PORT"]})
        assert no_cert.returncode != 0
        other_ca = tmp_path / "other"
        grid_main(["certs", str(other_ca), "x"])
        wrong_ca = _healthcheck({**env, "LARQL_TLS_CA_FILE": str(other_ca / "ca.crt")})
        assert wrong_ca.returncode != 0 and "certificate verify failed" in wrong_ca.stderr
        pem_env = _healthcheck({"LARQL_PORT": env["LARQL_PORT"], "LARQL_TLS_CERT": (d / "router/tls.crt").read_text(),
                                "LARQL_TLS_KEY": (d / "router/tls.key").read_text(),
                                "LARQL_TLS_CA": (d / "ca.crt").read_text()})
        assert pem_env.returncode == 0, pem_env.stderr  # the PEMs themselves in the environment


@pytest.mark.multiprocess
def test_edge_start_renders_nginx_with_tls_on_both_sides(tmp_path):
    """larql-edge-start with LARQL_TLS_*: nginx listens with TLS only and proxies to https:// embed
    servers, verified under their name, presenting its certificate (nginx -t checks the result)."""
    import shutil

    if shutil.which("nginx") is None and not os.environ.get("CI"):
        pytest.skip("nginx not installed")
    grid_main(["certs", str(tmp_path / "tls"), "edge"])
    d = tmp_path / "tls"
    prefix = tmp_path / "prefix"
    env = {**os.environ, "LARQL_EDGE_PREFIX": str(prefix), "LARQL_EDGE_TEMPLATE": str(ROOT / "deploy/nginx/nginx.conf"),
           "LARQL_EDGE_UPSTREAMS": "127.0.0.1:8082", "LARQL_EDGE_UPSTREAM_NAME": "embed",
           "LARQL_TLS_CERT_FILE": str(d / "edge/tls.crt"), "LARQL_TLS_KEY_FILE": str(d / "edge/tls.key"),
           "LARQL_TLS_CA_FILE": str(d / "ca.crt")}
    proc = subprocess.run(["sh", str(ROOT / "docker/roles/larql-edge-start"), "-t"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    conf = (prefix / "nginx.conf").read_text()
    assert "listen 8080 ssl;" in conf and "proxy_ssl_verify on;" in conf and "proxy_ssl_name embed;" in conf
    assert "proxy_pass http://" not in conf and conf.count("proxy_pass https://larql_embed") >= 2
    assert f"proxy_ssl_certificate {d / 'edge/tls.crt'};" in conf
    bad = subprocess.run(["sh", str(ROOT / "docker/roles/larql-edge-start"), "-t"],
                         env={**env, "LARQL_TLS_KEY_FILE": ""}, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "go together" in bad.stderr
    varnish = subprocess.run(["sh", str(ROOT / "docker/roles/larql-varnish-start"), "--check"], env=env,
                             capture_output=True, text=True, timeout=60)
    assert varnish.returncode == 2 and "use the nginx edge" in varnish.stderr


# ---- compose.tls.yaml with the real Docker engine -------------------------------------------------

def _greedy(vindex, prompt: str, n: int) -> list[int]:
    """The local forward pass on the f16 vindex the images extract: the token ids to compare with."""
    from larql_edge.format.vindex import Vindex
    from larql_edge.model.forward import Transformer

    vx = Vindex.open(vindex)
    return list(Transformer.local(vx).generate(vx.load_tokenizer().encode(prompt).ids, n, stop_ids=[]))


def _plain_http_refused(port: int) -> bool:
    """True when a plain-HTTP request to the port gets no HTTP reply (the TLS server drops it)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /v1/health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        try:
            data = s.recv(4096)
        except (ConnectionResetError, TimeoutError):
            data = b""
    return not data.startswith(b"HTTP/1.1 2")


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.timeout(3600)
def test_docker_compose_tls_grid_generates_and_refuses_plain_http(tmp_path, gemma_f16):
    """`larql-grid certs` then `docker compose -f compose.yaml -f compose.tls.yaml up grid`: every
    service healthy through its TLS healthcheck, the grid's own generation done over mutual TLS, a
    generation through the client container, the published router/embed/serve/edge ports speaking TLS
    only (plain HTTP gets no HTTP reply), a client without a certificate or with another CA's refused
    by the router, Prometheus scraping every role over https."""
    from tests import _docker as dk

    dk.require_engine()
    tls_dir = tmp_path / "tls"
    assert grid_main(["certs", str(tls_dir), "--readable-keys"]) == 0
    grid_main(["certs", str(tmp_path / "other"), "stranger", "--readable-keys"])
    ports = {"LARQL_ROUTER_PUBLISH": dk.free_port(), "LARQL_EMBED_PUBLISH": dk.free_port(),
             "LARQL_EDGE_PUBLISH": dk.free_port(), "LARQL_PROMETHEUS_PUBLISH": dk.free_port(),
             "LARQL_SERVE_PUBLISH": dk.free_port()}
    env = {k: str(v) for k, v in ports.items()}
    env.update(LARQL_TAG=dk.TAG, LARQL_GRID_KEY="larql-test-tls-grid-key", LARQL_DEMO_TOKENS="4",
               LARQL_TLS_DIR=str(tls_dir), LARQL_EDGE="nginx")
    project = f"{dk.PREFIX}-tls"
    compose = [*dk.compose_cmd(), "-p", project, "-f", str(ROOT / "compose.yaml"), "-f", str(ROOT / "compose.tls.yaml")]
    cenv = {**env, "COMPOSE_PROJECT_NAME": project}
    log_path = tmp_path / "compose-up.log"
    up = None
    try:
        with open(log_path, "wb") as log:
            up = subprocess.Popen([*compose, "up", "grid", "serve"], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                  env={**os.environ, **cenv}, stdin=subprocess.DEVNULL, start_new_session=True)
        t0 = time.monotonic()
        deadline = t0 + 900
        grid_c = None
        while grid_c is None or dk.health(grid_c) != "healthy":
            assert up.poll() is None, f"compose up exited ({up.returncode}):\n{log_path.read_text()[-6000:]}"
            assert time.monotonic() < deadline, f"grid not healthy in 900s:\n{log_path.read_text()[-6000:]}"
            grid_c = grid_c or dk.compose_container(project, "grid")
            if grid_c is not None:
                assert dk.health(grid_c) not in ("exited", "dead", "unhealthy"), log_path.read_text()[-6000:]
            time.sleep(2)
        up_s = time.monotonic() - t0
        for svc in ("router", "embed", "ffn-a", "ffn-b", "edge", "prometheus"):
            assert dk.health(dk.compose_container(project, svc)) == "healthy", svc
        logs = grid_c.logs().decode()
        assert "grid is up" in logs and "demo:" in logs, logs[-3000:]

        # a generation through the client container (verifies the router, presents the client certificate)
        proc = dk.run([*compose, "--profile", "client", "run", "--rm", "client", "generate", "--prompt",
                       "The capital of France is", "--max-tokens", "6", "--json"], timeout=600, env=cenv)
        res = dk.json_line(proc.stdout)
        assert res["generated_ids"] == _greedy(gemma_f16, "The capital of France is", 6), res

        # the published ports: TLS only, verified under localhost with the grid's CA
        ca, client = str(tls_dir / "ca.crt"), (str(tls_dir / "client/tls.crt"), str(tls_dir / "client/tls.key"))
        router = f"https://localhost:{ports['LARQL_ROUTER_PUBLISH']}"
        with httpx.Client(verify=ssl.create_default_context(cafile=ca), cert=client, timeout=10) as c:
            assert c.get(router + "/v1/ready").json()["complete"]
            embed_row = c.get(f"https://localhost:{ports['LARQL_EDGE_PUBLISH']}/v1/embed/100")
            assert embed_row.status_code == 200 and len(embed_row.content) == 640 * 4
        serve_c = dk.compose_container(project, "serve")
        deadline = time.monotonic() + 300
        while dk.health(serve_c) != "healthy":
            assert time.monotonic() < deadline, serve_c.logs().decode()[-3000:]
            time.sleep(2)
        models = httpx.get(f"https://localhost:{ports['LARQL_SERVE_PUBLISH']}/v1/models",
                           verify=ssl.create_default_context(cafile=ca), timeout=10)
        assert models.status_code == 200
        for name in ("LARQL_ROUTER_PUBLISH", "LARQL_EMBED_PUBLISH", "LARQL_EDGE_PUBLISH", "LARQL_SERVE_PUBLISH"):
            assert _plain_http_refused(ports[name]), name
        # mutual TLS at the router: no client certificate, or one of another CA: refused in the handshake
        for cert in (None, (str(tmp_path / "other/stranger/tls.crt"), str(tmp_path / "other/stranger/tls.key"))):
            with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
                httpx.get(router + "/v1/ready", verify=ssl.create_default_context(cafile=ca), cert=cert, timeout=10)

        # Prometheus scrapes every role over https with its client certificate
        deadline = time.monotonic() + 90
        while True:
            targets = httpx.get(f"http://127.0.0.1:{ports['LARQL_PROMETHEUS_PUBLISH']}/api/v1/targets", timeout=5).json()
            larql = [t for t in targets["data"]["activeTargets"] if t["labels"]["job"].startswith("larql-")]
            if len(larql) == 4 and all(t["health"] == "up" for t in larql):
                break
            assert time.monotonic() < deadline, [(t["scrapeUrl"], t["health"], t["lastError"]) for t in larql]
            time.sleep(2)
        assert all(t["scrapeUrl"].startswith("https://") for t in larql)
        print(f"\n[tls-compose] healthy in {up_s:.0f}s; client generate: {res['text']!r}")
    finally:
        subprocess.run([*compose, "--profile", "client", "down", "-v", "--remove-orphans", "--timeout", "10"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, **cenv},
                       stdin=subprocess.DEVNULL)
        if up is not None and up.poll() is None:
            os.killpg(up.pid, signal.SIGTERM)
            try:
                up.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait(timeout=30)

