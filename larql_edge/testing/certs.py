"""Certificates for TLS tests and benchmarks, made at run time with `cryptography` (none is checked in).

`Pki(folder)` makes a CA; `issue(name)` a certificate it signs for ``localhost`` and ``127.0.0.1``,
usable by a server and as a client certificate (mutual TLS). Files are PEM, keys mode 0600. The CA
itself is `larql-grid certs`'s (`larql_edge.tools.grid.pki`), so the tests exercise what operators run.
"""

from __future__ import annotations

from pathlib import Path

from larql_edge.tools.grid.pki import Authority, Issued

__all__ = ["Issued", "Pki"]


class Pki(Authority):
    def __init__(self, folder: Path, name: str = "larql-test-ca", days: int = 2):
        super().__init__(folder, name=name, days=days)
        self.name = name
        self.days = days

    def issue(self, name: str, hosts: tuple[str, ...] = ("localhost", "127.0.0.1"), **kw) -> Issued:  # type: ignore[override]
        return super().issue(name, hosts, days=self.days, **kw)
