"""The service toolkit every larql-edge server is built from (embed server, FFN shard, router, ...).

Public surface:

- `make_app(name, role, hooks, max_body=...)`: a Sanic app with the error envelope, metrics
  (``larql_<role>_*``), the ops routes (health, ready, stats, openapi) and a compute pool;
- `Hooks`: what a role's ops routes answer, and its in-flight count;
- `body_kind`, `json_body`, `json_object`, `parse_json`: one content-type rule, bounded JSON;
- `Compute`: work off the event loop with an in-flight count;
- `Metrics`: the role's metric families;
- `add_server_flags`, `pin_blas`, `setup_logging`, `serve`, `tls_settings`: what every server's `main` does.
"""

from larql_edge.net.tls import settings_from_args as tls_settings

from ._app import make_app
from ._bodies import BINARY_KIND, JSON_KIND, body_kind, content_type, json_body, json_object, parse_json, read_body
from ._compute import Compute
from ._envelope import error_response, install_error_envelope
from ._ops import Hooks
from .metrics import Metrics
from .serving import add_server_flags, pin_blas, serve, setup_logging

__all__ = [
    "BINARY_KIND", "JSON_KIND", "Compute", "Hooks", "Metrics", "add_server_flags", "body_kind", "content_type",
    "error_response", "install_error_envelope", "json_body", "json_object", "make_app", "parse_json", "pin_blas",
    "read_body", "serve", "setup_logging", "tls_settings",
]  # fmt: skip
