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


def _serial(host: str, port: int, ca: Path) -> int:
    ctx = ssl.create_default_context(cafile=str(ca))
    with ctx.wrap_socket(__import__("socket").create_connection((host, port), timeout=5), server_hostname=host) as s:
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
            await asyncio.sleep(0)  # let the transports close on this loop

    return asyncio.run(go())


class _TlsServer:
    """A real HTTPS server (the stdlib's) in a thread, with the context larql's servers use."""

    def __init__(self, ctx: ssl.SSLContext):
        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

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
    with _TlsServer(ctx) as srv:
        first = _serial("127.0.0.1", srv.port, pki.ca)
        assert not r.check()  # nothing changed
        live.cert.write_bytes(a.cert.read_bytes())
        live.key.write_bytes(a.key.read_bytes())
        assert r.check() and r.reloads == 1
        second = _serial("127.0.0.1", srv.port, pki.ca)
        assert second != first
        live.cert.write_bytes(b.cert.read_bytes())  # b's certificate with a's key: refused, a stays
        assert not r.check()
        assert _serial("127.0.0.1", srv.port, pki.ca) == second


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
