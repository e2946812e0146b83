"""TLS on every hop: the flags, the client context every client of this process verifies with, and
the server context (with mutual TLS and certificate reload).

One process-wide client context (`client_context`): the clients of the hot path (``h1_sync``,
``h1_async``), the membership traffic (httpx) and the probes all verify servers against the same
CA (``--tls-ca``; the system's trust store without it) and present the same client certificate
when a server asks for one (mutual TLS). A server presents ``--tls-cert``/``--tls-key``; with
``--tls-client-ca`` it also demands a client certificate signed by that CA, so a member or client
without one is refused in the handshake, before any HTTP. A server with TLS on speaks nothing else:
a plain-HTTP request on its port never reaches a handler.

Certificates and keys are files (what ``ssl`` loads and what a Swarm secret or a Kubernetes Secret
mounts); the ``_FILE`` twins mean the same. An environment variable may also hold the PEM itself
(``LARQL_TLS_KEY="-----BEGIN ..."``): it is written to a private file. Reload: `Reloader` loads the
chain again into the same contexts, so new connections get the new certificate and open ones keep
theirs (SIGHUP, or a change of the files, which is how cert-manager renews a mounted Secret).
"""

from __future__ import annotations

import logging
import os
import re
import ssl
import tempfile
from dataclasses import dataclass
from typing import Any

from larql_edge.config import Flags
from larql_edge.errors import SetupError

log = logging.getLogger("larql.tls")

PEM_START = "-----BEGIN"
_HOST_NAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")


@dataclass(frozen=True)
class TlsSettings:
    """Paths (PEM files). ``cert``/``key``: what a server presents, and what this process presents as a
    client when a server asks; ``ca``: what servers are verified against; ``client_ca``: a server's
    demand for client certificates (mutual TLS)."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    client_ca: str | None = None
    server_name: str | None = None

    @property
    def serving(self) -> bool:
        return bool(self.cert)


def add_tls_flags(flags: Flags, server: bool) -> None:
    """``--tls-ca`` for every process that connects; ``--tls-cert --tls-key`` (a server's certificate,
    and the client certificate it presents; a client's certificate for mutual TLS); for a server
    ``--tls-client-ca``. Each with its ``_FILE`` twin."""
    who = "this server's certificate (PEM; also presented as the client certificate when a server asks)" if server \
        else "client certificate (PEM) presented to servers that require one (mutual TLS)"
    flags.add("--tls-cert", default=None, metavar="PATH", path_twin=True,
              help=who + (": TLS on, https only" if server else ""))
    flags.add("--tls-key", default=None, metavar="PATH", path_twin=True, help="private key (PEM) of --tls-cert")
    flags.add("--tls-ca", default=None, metavar="PATH", path_twin=True,
              help="CA certificate(s) (PEM) that https:// servers are verified against (default: the system's trust store)")
    flags.add("--tls-server-name", default=None, metavar="NAME",
              help="verify every https:// server under this name instead of its URL's host (a grid whose "
                   "members cannot be named in advance, e.g. Swarm tasks: one grid-wide name only the grid's CA issues)")
    if server:
        flags.add("--tls-client-ca", default=None, metavar="PATH", path_twin=True,
                  help="demand client certificates signed by this CA (mutual TLS; needs --tls-cert)")


def settings_from_args(args: Any) -> TlsSettings:
    """Checked settings from parsed flags (`add_tls_flags`); makes them this process's client context.

    Raises SetupError with a one-line message (never a key's content)."""
    cert, key, ca, client_ca = (_materialize(getattr(args, f"tls_{n}", None), f"--tls-{n.replace('_', '-')}")
                                for n in ("cert", "key", "ca", "client_ca"))
    s = TlsSettings(cert, key, ca, client_ca, server_name=getattr(args, "tls_server_name", None) or None)
    if s.server_name is not None and not _HOST_NAME.match(s.server_name):
        raise SetupError(f"--tls-server-name {s.server_name!r}: not a DNS name")
    if bool(s.cert) != bool(s.key):
        raise SetupError("--tls-cert and --tls-key go together")
    if s.client_ca and not s.cert:
        raise SetupError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
    if s.serving:
        server_context(s)  # refuse unusable files now, with one line, not at the first handshake
    configure_client(s)
    return s


def _materialize(value: str | None, what: str) -> str | None:
    """A path as given; a PEM held in an environment variable becomes a private file (mode 0600)."""
    if not value:
        return None
    if value.lstrip().startswith(PEM_START):
        fd, path = tempfile.mkstemp(prefix="larql-tls-", suffix=".pem")
        with os.fdopen(fd, "w") as f:
            f.write(value)
        return path
    if not os.path.isfile(value):
        raise SetupError(f"{what} {value}: no such file")
    return value


def _load_chain(ctx: ssl.SSLContext, cert: str, key: str, what: str) -> None:
    try:
        ctx.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as e:
        raise SetupError(f"{what} {cert} / {key}: cannot load the certificate and key "
                         f"({getattr(e, 'reason', None) or e.strerror or type(e).__name__})") from None


def _load_ca(ctx: ssl.SSLContext, ca: str, what: str) -> None:
    try:
        ctx.load_verify_locations(cafile=ca)
    except (ssl.SSLError, OSError) as e:
        raise SetupError(f"{what} {ca}: not a PEM CA certificate ({getattr(e, 'reason', None) or type(e).__name__})") \
            from None


def _load_ca_data(ctx: ssl.SSLContext, pem: str, what: str, path: str) -> None:
    try:
        ctx.load_verify_locations(cadata=pem)
    except (ssl.SSLError, ValueError) as e:
        raise SetupError(f"{what} {path}: not a PEM CA certificate ({getattr(e, 'reason', None) or e})") from None
    if not ctx.get_ca_certs():
        raise SetupError(f"{what} {path}: no CA certificate in the file")


def server_context(s: TlsSettings) -> ssl.SSLContext:
    assert s.cert and s.key
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["http/1.1"])
    _load_chain(ctx, s.cert, s.key, "--tls-cert/--tls-key")
    if s.client_ca:
        _load_ca(ctx, s.client_ca, "--tls-client-ca")
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def make_client_context(s: TlsSettings) -> ssl.SSLContext:
    ctx = ssl.create_default_context()  # verifies the chain and the host name; TLS 1.2 or later
    if s.ca:
        _load_ca(ctx, s.ca, "--tls-ca")
    if s.cert and s.key:
        _load_chain(ctx, s.cert, s.key, "--tls-cert/--tls-key")
    return ctx


_client: ssl.SSLContext | None = None
_client_settings = TlsSettings()


def configure_client(s: TlsSettings) -> None:
    """Make ``s`` this process's client side (called once, from a command's flags)."""
    global _client, _client_settings
    _client_settings = s
    _client = make_client_context(s) if (s.ca or s.cert) else None


def verify_name(host: str) -> str:
    """The name an https:// server at ``host`` is verified under (and sent as SNI): ``host`` itself,
    unless ``--tls-server-name`` names one for every server."""
    return _client_settings.server_name or host


def client_context() -> ssl.SSLContext:
    """The context every https:// connection of this process verifies with."""
    global _client
    if _client is None:
        _client = ssl.create_default_context()
    return _client


class Reloader:
    """Loads the files again into the live contexts when asked (SIGHUP) or when they change: the
    certificate and key into every context, ``--tls-client-ca`` into the server contexts (whose
    client certificates are checked) and ``--tls-ca`` into the client contexts (whose servers are).

    A failed reload (a half-written file, a key that does not match, a CA file that is not PEM)
    keeps what is in use and says why in the log; the next change tries again. A CA file is added
    to what the context trusts: a CA appended to the file (the first step of a rotation) is trusted
    at once, but one removed from it stays trusted until the process restarts (``ssl`` can add to a
    context's trust store, not take from it; DESIGN.md §14)."""

    def __init__(self, s: TlsSettings, contexts: list[ssl.SSLContext],
                 client_contexts: list[ssl.SSLContext] | tuple = ()):
        self.cert, self.key = s.cert, s.key
        self.contexts = list(contexts)  # servers: chain + client CA
        self.client_contexts = list(client_contexts)  # clients: chain + CA
        self.ca, self.client_ca = s.ca, s.client_ca
        self.reloads = 0
        self.ca_reloads = 0
        self._seen = self._stamp(self._chain_files())
        self._seen_ca = {p: self._stamp([p]) for p in self._ca_files()}

    def _chain_files(self) -> list[str]:
        return [p for p in (self.cert, self.key) if p]

    def _ca_files(self) -> list[str]:
        return [p for p in (self.ca, self.client_ca) if p]

    @staticmethod
    def _stamp(paths: list[str]) -> tuple:
        out: list[tuple[int, int, int] | None] = []
        for p in paths:
            try:
                st = os.stat(p)
                out.append((st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError:
                out.append(None)
        return tuple(out)

    def check(self) -> bool:
        """Reload what changed since the last look; True when a reload took."""
        took = False
        stamp = self._stamp(self._chain_files())
        if stamp != self._seen:
            self._seen = stamp
            took = self._reload_chain("the files changed")
        for path, seen in self._seen_ca.items():
            stamp = self._stamp([path])
            if stamp != seen:
                self._seen_ca[path] = stamp
                took = self._reload_ca(path, "the file changed") or took
        return took

    def reload(self, why: str = "SIGHUP") -> bool:
        """Everything, now (SIGHUP). True when every file loaded."""
        ok = self._reload_chain(why) if self.cert and self.key else True
        for path in self._ca_files():
            ok = self._reload_ca(path, why) and ok
        return ok

    def _reload_chain(self, why: str) -> bool:
        # A failed load_cert_chain leaves a context holding the new certificate with the old key
        # (every handshake then fails): load a snapshot of the files into a scratch context first,
        # and only a pair that loads there into the live ones.
        assert self.cert and self.key
        with tempfile.TemporaryDirectory(prefix="larql-tls-") as tmp:
            try:
                cert, key = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
                for src, dst in ((self.cert, cert), (self.key, key)):
                    with open(src, "rb") as f, open(os.open(dst, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as g:
                        g.write(f.read())
                _load_chain(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), cert, key, "--tls-cert/--tls-key")
            except (SetupError, OSError) as e:
                log.error("TLS certificate not reloaded (%s): %s; keeping the one in use", why, e)
                return False
            for ctx in self.contexts + self.client_contexts:
                ctx.load_cert_chain(cert, key)
        self.reloads += 1
        log.info("TLS certificate reloaded from %s (%s)", self.cert, why)
        return True

    def _reload_ca(self, path: str, why: str) -> bool:
        targets = ([c for c in self.contexts] if path == self.client_ca else []) + \
                  ([c for c in self.client_contexts] if path == self.ca else [])
        what = "--tls-client-ca" if path == self.client_ca else "--tls-ca"
        try:
            with open(path, "rb") as f:
                pem = f.read().decode("ascii")
            _load_ca_data(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), pem, what, path)  # the whole file, or nothing
        except (SetupError, OSError, UnicodeDecodeError) as e:
            log.error("TLS CA not reloaded (%s): %s; keeping the CAs in use", why, e)
            return False
        for ctx in targets:
            ctx.load_verify_locations(cadata=pem)
        self.ca_reloads += 1
        log.info("TLS CA reloaded from %s (%s)", path, why)
        return True
