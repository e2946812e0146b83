"""A grid's own certificate authority: ``larql-grid certs``, and the certificates of the TLS tests.

    larql-grid certs DIR [NAME[=HOST,HOST...] ...] [--days 365] [--ca-days 3650] [--renew] [--readable-keys]

DIR/ca.crt and DIR/ca.key are the grid's CA (made once, then reused: run the command again to add
names). Each NAME gets DIR/NAME/{tls.crt,tls.key,ca.crt}: the key names of a Kubernetes TLS Secret
as cert-manager writes it, so ``kubectl create secret generic NAME --from-file=DIR/NAME`` and Docker
secrets take the folder as it is. A certificate covers its HOSTs (DNS names, wildcards, IP addresses;
default: NAME itself) and serves as both server and client certificate (mutual TLS), because every
member is both. Without NAMEs: the services of the repo's compose.yaml. Keys are P-256, written mode
0600 in folders of mode 0700; the CA key is what an attacker needs to join the grid, so keep DIR out
of images and repos. ``--readable-keys`` writes the service keys 0644 (the folders stay 0700): Docker
Compose mounts a file secret with its owner and mode on the host, and the images run as uid 10001.

Needs the ``cryptography`` package (``pip install 'larql-edge[tls]'``); the servers themselves only
load PEM files with the standard library.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from larql_edge.config import Flags
from larql_edge.errors import LarqlError

# The services of compose.yaml (compose.tls.yaml mounts DIR/<service>): servers by their service
# name, plus localhost for those published on the host's loopback (a client there connects to
# https://localhost:PORT); `client` for the attention-only clients (grid, client: a client
# certificate only).
_LOOPBACK = "localhost,127.0.0.1"
COMPOSE_NAMES = (f"router=router,{_LOOPBACK}", f"embed=embed,{_LOOPBACK}", "ffn-a", "ffn-b",
                 f"serve=serve,{_LOOPBACK}", f"edge=edge,{_LOOPBACK}", "prometheus", "client")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


def _crypto():
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        raise LarqlError("making certificates needs the cryptography package: pip install 'larql-edge[tls]' "
                         "(or make them with your own CA: any PEM certificate and key will do)") from None
    return x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


def _write(path: Path, data: bytes, private: bool = False) -> None:
    # Created with its final mode (no window where a key is world-readable), replaced in one rename.
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    tmp.replace(path)


def _sans(hosts: tuple[str, ...]) -> list[Any]:
    x509 = _crypto()[0]
    out: list[Any] = []
    for h in hosts:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            out.append(x509.DNSName(h))
    return out


class Authority:
    """A CA (P-256, self-signed, path length 0) in ``folder``: loaded when ``name``.crt/.key exist there,
    else made. ``issue`` signs leaf certificates for servers and clients alike."""

    def __init__(self, folder: Path, name: str = "larql-grid-ca", days: int = 3650, file_stem: str | None = None):
        x509, hashes, serialization, ec, _, NameOID = _crypto()
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        stem = file_stem or name
        self.ca, self.ca_key = self.folder / f"{stem}.crt", self.folder / f"{stem}.key"
        self.created = not (self.ca.exists() and self.ca_key.exists())
        if not self.created:
            try:
                self.cert = x509.load_pem_x509_certificate(self.ca.read_bytes())
                self.key = serialization.load_pem_private_key(self.ca_key.read_bytes(), password=None)
            except ValueError as e:
                raise LarqlError(f"{self.ca} / {self.ca_key}: not a PEM CA certificate and key ({e})") from None
            return
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = dt.datetime.now(dt.timezone.utc)
        self.cert = (
            x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(self.key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        _write(self.ca_key, self._key_pem(self.key), private=True)
        _write(self.ca, self.cert.public_bytes(serialization.Encoding.PEM))

    @staticmethod
    def _key_pem(key: Any) -> bytes:
        serialization = _crypto()[2]
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    def issue(self, name: str, hosts: tuple[str, ...], days: int = 365, cert: Path | None = None,
              key: Path | None = None, key_private: bool = True) -> Issued:
        """A certificate for ``hosts`` (DNS names, ``*.`` wildcards, IPs), server and client auth."""
        x509, hashes, serialization, ec, EKU, NameOID = _crypto()
        if not hosts:
            raise LarqlError(f"{name}: a certificate needs at least one host name")
        leaf_key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.timezone.utc)
        leaf = (
            x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name[:64])]))
            .issuer_name(self.cert.subject).public_key(leaf_key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(_sans(hosts)), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, key_cert_sign=False,
                                         crl_sign=False, content_commitment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([EKU.SERVER_AUTH, EKU.CLIENT_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        out = Issued(cert or self.folder / f"{name}.crt", key or self.folder / f"{name}.key")
        _write(out.key, self._key_pem(leaf_key), private=key_private)
        _write(out.cert, leaf.public_bytes(serialization.Encoding.PEM))
        return out


def parse_name(spec: str) -> tuple[str, tuple[str, ...]]:
    """``NAME`` or ``NAME=HOST,HOST``: the folder name and the hosts its certificate covers."""
    name, _, hosts = spec.partition("=")
    if not _NAME.match(name):
        raise LarqlError(f"{spec!r}: a name is letters, digits, '.', '_' or '-' (it names a folder)")
    listed = tuple(h.strip() for h in hosts.split(",") if h.strip()) if hosts else (name,)
    return name, listed


def add_certs_parser(sub: Any) -> None:
    p = sub.add_parser("certs", help="make the grid's CA and a certificate per service (TLS; needs cryptography)",
                       description=__doc__.split("\n\n")[1] if __doc__ else None,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", metavar="DIR", help="where the CA and the per-name folders go")
    p.add_argument("names", metavar="NAME[=HOST,...]", nargs="*",
                   help="a certificate per NAME, for its HOSTs (default: NAME); none: compose.yaml's services "
                        f"({' '.join(n.split('=')[0] for n in COMPOSE_NAMES)}; the published ones also for localhost)")
    f = Flags(p)
    c = lambda flag: "LARQL_CERTS_" + flag.lstrip("-").replace("-", "_").upper()  # noqa: E731
    f.add("--days", type=int, default=365, env=c("--days"), help="validity of the certificates issued now")
    f.add("--ca-days", type=int, default=3650, env=c("--ca-days"), help="validity of the CA, when it is made")
    f.switch("--renew", env=c("--renew"), help="issue again the names that already have a certificate")
    f.switch("--readable-keys", env=c("--readable-keys"),
             help="service keys mode 0644 inside 0700 folders (Docker Compose file secrets keep the host's mode; "
                  "the images run as uid 10001)")
    p.set_defaults(func=certs_command)


def certs_command(args: argparse.Namespace) -> int:
    if args.days < 1 or args.ca_days < 1:
        raise LarqlError("--days and --ca-days must be at least 1")
    specs = [parse_name(s) for s in (args.names or COMPOSE_NAMES)]
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    ca = Authority(out, days=args.ca_days, file_stem="ca")
    print(f"larql-grid certs: CA {'made' if ca.created else 'reused'}: {ca.ca} (key {ca.ca_key}, keep it private)",
          flush=True)
    for name, hosts in specs:
        folder = out / name
        if (folder / "tls.crt").exists() and not args.renew:
            print(f"  {name}: kept (--renew issues it again)", flush=True)
            continue
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
        ca.issue(name, hosts, days=args.days, cert=folder / "tls.crt", key=folder / "tls.key",
                 key_private=not args.readable_keys)
        _write(folder / "ca.crt", ca.ca.read_bytes())
        print(f"  {name}: {folder}/{{tls.crt,tls.key,ca.crt}} for {', '.join(hosts)}", flush=True)
    return 0
