"""TLS on every hop (issue 19). Certificates are made here with `cryptography` (larql_edge.testing.certs).

Fast tier, in-process: the flags and their `_FILE` twins, the one-line setup errors, certificate
reload, and both HTTP/1.1 clients against a real TLS server in a thread: verified against the CA,
refused for another CA, refused at the TLS layer without a client certificate when the server
demands one (mutual TLS).
Slow tier: a grid of processes with mutual TLS on every hop (see test_tls_grid_* below).
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import ssl
import threading
import time
from pathlib import Path

import pytest

from larql_edge.config import Flags
from larql_edge.errors import ConnectFailed, ConnectionLost, SetupError
from larql_edge.net import tls
from larql_edge.net.h1_async import H1Pool
from larql_edge.net.h1_sync import HttpClient
from larql_edge.testing.certs import Pki


@pytest.fixture
def pki(tmp_path):
    return Pki(tmp_path / "pki")


@pytest.fixture(autouse=True)
def _client_side_reset():
    yield
    tls.configure_client(tls.TlsSettings())  # a test's CA must not become the next test's


def _parse(argv, env=None, server=True, monkeypatch=None):
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    p = argparse.ArgumentParser()
    tls.add_tls_flags(Flags(p), server=server)
    return p.parse_args(argv)


def test_flags_and_their_file_twins(pki, monkeypatch):
    s = pki.issue("server")
    a = _parse(["--tls-cert", str(s.cert), "--tls-key-file", str(s.key)], monkeypatch=monkeypatch)
    assert (a.tls_cert, a.tls_key) == (str(s.cert), str(s.key))
    a = _parse([], {"LARQL_TLS_CERT_FILE": str(s.cert), "LARQL_TLS_KEY_FILE": str(s.key),
                    "LARQL_TLS_CLIENT_CA_FILE": str(pki.ca)}, monkeypatch=monkeypatch)
    got = tls.settings_from_args(a)
    assert got == tls.TlsSettings(str(s.cert), str(s.key), None, str(pki.ca)) and got.serving


def test_a_pem_held_in_the_environment_becomes_a_private_file(pki, monkeypatch):
    s = pki.issue("server")
    a = _parse([], {"LARQL_TLS_CERT": s.cert.read_text(), "LARQL_TLS_KEY": s.key.read_text()}, monkeypatch=monkeypatch)
    got = tls.settings_from_args(a)
    assert got.key and Path(got.key).read_bytes() == s.key.read_bytes()
    assert Path(got.key).stat().st_mode & 0o077 == 0


@pytest.mark.parametrize("argv,message", [
    (["--tls-cert", "CERT"], "go together"),
    (["--tls-client-ca", "CA"], "needs --tls-cert"),
    (["--tls-ca", "/nonexistent/ca.pem"], "no such file"),
    (["--tls-cert", "CERT", "--tls-key", "OTHERKEY"], "cannot load the certificate and key"),
    (["--tls-ca", "KEY"], "not a PEM CA certificate"),
])
def test_bad_tls_settings_are_one_line_setup_errors(pki, argv, message, monkeypatch):
    s, other = pki.issue("server"), pki.issue("other")
    names = {"CERT": str(s.cert), "OTHERKEY": str(other.key), "CA": str(pki.ca), "KEY": str(s.key)}
    a = _parse([names.get(x, x) for x in argv], monkeypatch=monkeypatch)
    with pytest.raises(SetupError) as e:
        tls.settings_from_args(a)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert "PRIVATE KEY" not in str(e.value)


def _serial(host: str, port: int, ctx: ssl.SSLContext) -> int:
    import socket

    with ctx.wrap_socket(socket.create_connection((host, port), timeout=5), server_hostname=host) as s:
        der = s.getpeercert(binary_form=True)
    from cryptography import x509

    return x509.load_der_x509_certificate(der).serial_number


def _async_get(url: str):
    async def go():
        pool = H1Pool(timeout=5)
        try:
            return await pool.request("GET", url)
        finally:
            await pool.aclose()
            await asyncio.sleep(0.2)  # a TLS transport takes a few turns of the loop to close

    return asyncio.run(go())


class _TlsServer:
    """A real HTTPS server (the stdlib's) in a thread, with the context larql's servers use."""

    def __init__(self, ctx: ssl.SSLContext):
        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # head and body are two writes (tests/_grid.py StubEmbed)

            def log_message(self, *a):
                pass

            def do_GET(self):
                body = b'{"ok": true}'
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        class Server(http.server.ThreadingHTTPServer):
            def get_request(self):
                sock, addr = super().get_request()
                return ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr

            def handle_error(self, request, client_address):
                pass  # a refused handshake is what some tests want

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"https://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def test_reload_takes_new_files_and_keeps_the_old_on_a_bad_pair(pki):
    a, b = pki.issue("a"), pki.issue("b")
    live = pki.issue("live")
    s = tls.TlsSettings(str(live.cert), str(live.key))
    ctx = tls.server_context(s)
    r = tls.Reloader(s, [ctx])
    verify = ssl.create_default_context(cafile=str(pki.ca))
    with _TlsServer(ctx) as srv:
        first = _serial("127.0.0.1", srv.port, verify)
        assert not r.check()  # nothing changed
        live.cert.write_bytes(a.cert.read_bytes())
        live.key.write_bytes(a.key.read_bytes())
        assert r.check() and r.reloads == 1
        second = _serial("127.0.0.1", srv.port, verify)
        assert second != first
        live.cert.write_bytes(b.cert.read_bytes())  # b's certificate with a's key: refused, a stays
        assert not r.check()
        assert _serial("127.0.0.1", srv.port, verify) == second


def test_both_clients_verify_against_the_grid_ca(pki, tmp_path):
    server = pki.issue("server")
    other_ca = Pki(tmp_path / "other", name="other-ca")
    with _TlsServer(tls.server_context(tls.TlsSettings(str(server.cert), str(server.key)))) as srv:
        # without the grid's CA (the system's trust store): refused, a ConnectFailed naming the cause
        tls.configure_client(tls.TlsSettings())
        with pytest.raises(ConnectFailed, match="certificate verify failed"):
            HttpClient(timeout=5).request("GET", srv.url + "/x")
        tls.configure_client(tls.TlsSettings(ca=str(other_ca.ca)))
        with pytest.raises(ConnectFailed, match="certificate verify failed"):
            _async_get(srv.url + "/x")
        tls.configure_client(tls.TlsSettings(ca=str(pki.ca)))
        assert HttpClient(timeout=5).request("GET", srv.url + "/x").json() == {"ok": True}
        assert _async_get(srv.url + "/x").json() == {"ok": True}


def test_a_waiter_watches_a_reply_over_tls_too(pki):
    """The hedged hops' `Waiter` (`HttpClient.request(waiter=)`) sees a TLS socket before its receives,
    as a plain one: a hop over TLS is hedged and stall-bounded the same way."""
    from larql_edge.errors import Stalled
    from larql_edge.net.hops import StallWaiter

    server = pki.issue("server")
    with _TlsServer(tls.server_context(tls.TlsSettings(str(server.cert), str(server.key)))) as srv:
        tls.configure_client(tls.TlsSettings(ca=str(pki.ca)))
        seen = []

        class Watch:
            def wait(self, sock, deadline):
                seen.append(type(sock).__name__)
                StallWaiter(5.0).wait(sock, deadline)

        class GiveUp:
            def wait(self, sock, deadline):
                raise Stalled("given up")

        c = HttpClient(timeout=5)
        assert c.request("GET", srv.url + "/x", waiter=Watch()).json() == {"ok": True}
        assert seen and all(n == "SSLSocket" for n in seen), seen
        with pytest.raises(Stalled, match="given up"):
            c.request("GET", srv.url + "/x", waiter=GiveUp())
        assert c.request("GET", srv.url + "/x").json() == {"ok": True}  # a new connection after the one given up


def test_mutual_tls_refuses_a_client_without_a_certificate_or_with_another_cas(pki, tmp_path):
    server, member = pki.issue("server"), pki.issue("member")
    other_ca = Pki(tmp_path / "other", name="other-ca")
    stranger = other_ca.issue("stranger")
    ctx = tls.server_context(tls.TlsSettings(str(server.cert), str(server.key), client_ca=str(pki.ca)))
    with _TlsServer(ctx) as srv:
        for who in (None, stranger):
            tls.configure_client(tls.TlsSettings(str(who.cert) if who else None, str(who.key) if who else None,
                                                 ca=str(pki.ca)))
            with pytest.raises((ConnectFailed, ConnectionLost)):
                HttpClient(timeout=5).request("GET", srv.url + "/x")
            with pytest.raises((ConnectFailed, ConnectionLost)):
                _async_get(srv.url + "/x")
        tls.configure_client(tls.TlsSettings(str(member.cert), str(member.key), ca=str(pki.ca)))
        assert HttpClient(timeout=5).request("GET", srv.url + "/x").status_code == 200
        assert _async_get(srv.url + "/x").status_code == 200


def _bundle(path: Path, *cas: Path) -> None:
    """Write a CA file in one step (a rename, as kubelet and cert-manager update a mounted Secret)."""
    tmp = path.with_suffix(".new")
    tmp.write_bytes(b"".join(c.read_bytes() for c in cas))
    tmp.replace(path)


def test_a_changed_client_ca_file_is_reloaded_into_the_server(pki, tmp_path):
    """Rotation's first step: the new CA appended to --tls-client-ca. Its members are refused before
    the change and accepted after, without a restart; a broken CA file changes nothing."""
    server = pki.issue("server")
    new_ca = Pki(tmp_path / "new", name="new-ca")
    newcomer = new_ca.issue("newcomer")
    client_ca = tmp_path / "client-ca.pem"
    _bundle(client_ca, pki.ca)
    s = tls.TlsSettings(str(server.cert), str(server.key), client_ca=str(client_ca))
    ctx = tls.server_context(s)
    r = tls.Reloader(s, [ctx])
    tls.configure_client(tls.TlsSettings(str(newcomer.cert), str(newcomer.key), ca=str(pki.ca)))
    with _TlsServer(ctx) as srv:
        with pytest.raises((ConnectFailed, ConnectionLost)):
            HttpClient(timeout=5).request("GET", srv.url + "/x")
        assert not r.check()  # nothing changed
        _bundle(client_ca, pki.ca, new_ca.ca)
        assert r.check() and r.ca_reloads == 1 and r.reloads == 0
        assert HttpClient(timeout=5).request("GET", srv.url + "/x").status_code == 200
        client_ca.write_bytes(b"-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
        assert not r.check() and r.ca_reloads == 1  # refused, logged; what was trusted stays trusted
        assert HttpClient(timeout=5).request("GET", srv.url + "/x").status_code == 200


def test_a_changed_ca_file_is_reloaded_into_the_client_context(pki, tmp_path):
    """--tls-ca of a server's own client side (the router's upstreams, serve's router): a server whose
    certificate comes from a CA added to the file is verified after the change, on new connections."""
    new_ca = Pki(tmp_path / "new", name="new-ca")
    upstream = new_ca.issue("upstream")
    ca = tmp_path / "ca.pem"
    _bundle(ca, pki.ca)
    s = tls.TlsSettings(ca=str(ca))
    tls.configure_client(s)
    r = tls.Reloader(s, [], [tls.client_context()])
    with _TlsServer(tls.server_context(tls.TlsSettings(str(upstream.cert), str(upstream.key)))) as srv:
        with pytest.raises(ConnectFailed, match="certificate verify failed"):
            HttpClient(timeout=5).request("GET", srv.url + "/x")
        _bundle(ca, pki.ca, new_ca.ca)
        assert r.check() and r.ca_reloads == 1
        assert HttpClient(timeout=5).request("GET", srv.url + "/x").json() == {"ok": True}
        assert _async_get(srv.url + "/x").json() == {"ok": True}
        ca.write_bytes(b"")  # an empty file (a half-written Secret): no CA, refused
        assert not r.reload("SIGHUP")
        assert HttpClient(timeout=5).request("GET", srv.url + "/x").status_code == 200


def test_tls_server_name_verifies_every_server_under_one_grid_name(pki, monkeypatch):
    """--tls-server-name (Swarm: task names cannot be in a certificate): a server whose certificate
    names only the grid is refused under its address, and accepted by both clients, and the
    membership's joins, under the grid name; a name of another grid is still refused."""
    from larql_edge.service.membership import RouterLink

    server = pki.issue("grid-member", hosts=("larql-grid",))
    with _TlsServer(tls.server_context(tls.TlsSettings(str(server.cert), str(server.key)))) as srv:
        tls.configure_client(tls.TlsSettings(ca=str(pki.ca)))
        with pytest.raises(ConnectFailed, match="certificate verify failed"):
            HttpClient(timeout=5).request("GET", srv.url + "/x")
        assert RouterLink(srv.url, "k", "https://m:1", "ffn", dict)._extensions == {}
        args = _parse(["--tls-ca", str(pki.ca), "--tls-server-name", "larql-grid"], server=False, monkeypatch=monkeypatch)
        assert tls.settings_from_args(args).server_name == "larql-grid"
        assert HttpClient(timeout=5).request("GET", srv.url + "/x").json() == {"ok": True}
        assert _async_get(srv.url + "/x").json() == {"ok": True}
        assert RouterLink(srv.url, "k", "https://m:1", "ffn", dict)._extensions == {"sni_hostname": "larql-grid"}
        tls.configure_client(tls.TlsSettings(ca=str(pki.ca), server_name="other-grid"))
        with pytest.raises(ConnectFailed, match="certificate verify failed"):
            HttpClient(timeout=5).request("GET", srv.url + "/x")
    with pytest.raises(SetupError, match="not a DNS name"):
        tls.settings_from_args(_parse(["--tls-server-name", "bad name/"], server=False, monkeypatch=monkeypatch))


# -- slow tier: a grid of processes with mutual TLS on every hop ------------------------------------

def _tls_env(pki_issued, pki: Pki, client_ca: bool) -> dict[str, str]:
    env = {"LARQL_TLS_CERT_FILE": str(pki_issued.cert), "LARQL_TLS_KEY_FILE": str(pki_issued.key),
           "LARQL_TLS_CA_FILE": str(pki.ca)}
    if client_ca:
        env["LARQL_TLS_CLIENT_CA_FILE"] = str(pki.ca)
    return env


def _plain_http_reply(port: int) -> bytes:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /v1/health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        try:
            return s.recv(4096)
        except (ConnectionResetError, TimeoutError):
            return b""


def _tls_request(port: int, ctx: ssl.SSLContext) -> bytes:
    """One HTTPS request with ``ctx``; raises ssl.SSLError / OSError when the TLS layer refuses."""
    import socket

    with ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10), server_hostname="127.0.0.1") as s:
        s.sendall(b"GET /v1/health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        data = s.recv(4096)
        if not data:
            raise ConnectionResetError("closed without a reply")
        return data


@pytest.fixture(scope="module")
def tls_grid(gemma_f32, tmp_path_factory):
    from larql_edge.testing.servers import console_script
    from larql_edge.tools.grid.supervisor import free_port
    from tests._grid import Procs, wait_grid

    root = tmp_path_factory.mktemp("tls-grid")
    pki = Pki(root / "pki")
    router_cert, member_cert, serve_cert, client_cert = (pki.issue(n) for n in ("router", "member", "serve", "client"))
    verify = tls.make_client_context(tls.TlsSettings(str(client_cert.cert), str(client_cert.key), ca=str(pki.ca)))
    with Procs(root / "logs") as procs:
        procs.sup.verify = verify

        def start(name, script, *args, env):
            port = free_port()
            return procs.sup.start(name, [*console_script(script), *args, "--port", str(port)],
                                   f"https://127.0.0.1:{port}", env=env)

        router = start("router", "larql-router", "--heartbeat-interval", "0.25", env=_tls_env(router_cert, pki, True))
        router.wait_ready(60)
        member_env = _tls_env(member_cert, pki, True)
        embed = start("embed", "larql-embed", str(gemma_f32), "--hot-cache", "64", "--join", router.url, env=member_env)
        shards = [start(f"ffn-{r}", "larql-ffn", str(gemma_f32), "--layers", r, "--join", router.url, env=member_env)
                  for r in ("0-8", "9-17")]
        for r in (embed, *shards):
            r.wait_ready(600)
        wait_grid(router.url, embed=1, timeout=120, verify=verify)
        serve = start("serve", "larql-serve", str(gemma_f32), "--ffn", router.url, "--served-model-name", "gemma3-270m",
                      "--context", "256", env=_tls_env(serve_cert, pki, False))
        serve.wait_ready(300)
        yield {"pki": pki, "router": router, "embed": embed, "shards": shards, "serve": serve, "verify": verify,
               "client": client_cert, "vindex": gemma_f32, "procs": procs, "root": root}


@pytest.mark.multiprocess
@pytest.mark.real_model
def test_tls_grid_larql_generate_and_openai_through_serve_give_the_golden_text(tls_grid, golden):
    import json

    import httpx
    import openai

    from tests._grid import larql

    g = tls_grid
    p = next(p for p in golden("gemma3-270m")["prompts"] if "greedy_ids" in p)
    out = larql("generate", "--vindex", str(g["vindex"]), "--ffn", g["router"].url, "--prompt", p["prompt"],
                "--max-tokens", "16", "--json", "--tls-ca", str(g["pki"].ca), "--tls-cert", str(g["client"].cert),
                "--tls-key", str(g["client"].key), timeout=600)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["generated_ids"] == p["greedy_ids"]
    # the same client without its certificate: refused by the router at the TLS layer, one line, non-zero
    out = larql("generate", "--vindex", str(g["vindex"]), "--ffn", g["router"].url, "--prompt", p["prompt"],
                "--max-tokens", "2", "--retries", "0", "--tls-ca", str(g["pki"].ca), timeout=300)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    with httpx.Client(verify=ssl.create_default_context(cafile=str(g["pki"].ca)), timeout=300) as http:
        client = openai.OpenAI(base_url=g["serve"].url + "/v1", api_key="unused", max_retries=0, http_client=http)
        r = client.completions.create(model="gemma3-270m", prompt=p["prompt"], max_tokens=16, temperature=0)
    assert r.choices[0].text == p["greedy_text"]


@pytest.mark.multiprocess
@pytest.mark.real_model
def test_tls_grid_refuses_members_without_a_grid_certificate_at_the_tls_layer(tls_grid, tmp_path):
    from tests._grid import wait_grid

    g = tls_grid
    stranger_ca = Pki(tmp_path / "stranger", name="stranger-ca")
    stranger = stranger_ca.issue("stranger")
    no_cert = ssl.create_default_context(cafile=str(g["pki"].ca))
    other_ca = tls.make_client_context(tls.TlsSettings(str(stranger.cert), str(stranger.key), ca=str(g["pki"].ca)))
    for role in (g["router"], *g["shards"], g["embed"]):
        for ctx in (no_cert, other_ca):
            with pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError)):
                _tls_request(role.port, ctx)
        assert _tls_request(role.port, g["verify"]).startswith(b"HTTP/1.1 200")
    # a real member holding another CA's certificate tries to join: it never becomes a member
    before = wait_grid(g["router"].url, embed=1, verify=g["verify"])
    from larql_edge.testing.servers import console_script
    from larql_edge.tools.grid.supervisor import free_port

    port = free_port()
    env = {"LARQL_TLS_CERT_FILE": str(stranger.cert), "LARQL_TLS_KEY_FILE": str(stranger.key),
           "LARQL_TLS_CA_FILE": str(g["pki"].ca)}
    intruder = g["procs"].sup.start("intruder", [*console_script("larql-ffn"), str(g["vindex"]), "--layers", "0-8",
                                                 "--join", g["router"].url, "--port", str(port)],
                                    f"https://127.0.0.1:{port}", env=env)
    try:
        deadline = time.monotonic() + 120
        while "unreachable" not in intruder.log() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "unreachable" in intruder.log(), intruder.log_tail()
        after = wait_grid(g["router"].url, embed=1, verify=g["verify"])
        assert len(after["members"]) == len(before["members"])
        assert all(m.get("public_url") != intruder.url for m in after["members"])
    finally:
        intruder.stop()


@pytest.mark.multiprocess
@pytest.mark.real_model
def test_tls_grid_every_server_refuses_plain_http(tls_grid):
    g = tls_grid
    for role in (g["router"], g["embed"], *g["shards"], g["serve"]):
        reply = _plain_http_reply(role.port)
        assert not reply.startswith(b"HTTP/1.1 200"), (role.name, reply[:80])
        assert b"/v1/" not in reply and b"{" not in reply, (role.name, reply[:80])


@pytest.mark.multiprocess
@pytest.mark.real_model
def test_tls_grid_router_reloads_its_certificate_on_sighup(tls_grid):
    import signal

    g = tls_grid
    router = g["router"]
    cert = g["pki"].folder / "router.crt"
    key = g["pki"].folder / "router.key"
    before = _serial("127.0.0.1", router.port, g["verify"])
    renewed = g["pki"].issue("router-renewed")
    key.write_bytes(renewed.key.read_bytes())
    cert.write_bytes(renewed.cert.read_bytes())
    router.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while _serial("127.0.0.1", router.port, g["verify"]) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _serial("127.0.0.1", router.port, g["verify"]) != before
    assert router.running() and "reloaded" in router.log()
