"""Wire codecs: one module per format (DESIGN.md §1). `WireError` (a 400) is what every decoder raises.

- `larql_edge.wire.embed`: the embed server's requests and responses (``/v1/embed``, ``/v1/logits``);
- `larql_edge.wire.ffn`: the FFN shard's ``/v1/walk-ffn``.

Every codec is little-endian and never trusts a length field without checking it against the body.
"""

from larql_edge.errors import WireError

# LARQL's binary content types, shared by the embed and FFN wires.
BINARY = "application/x-larql-ffn"
BINARY_F16 = "application/x-larql-ffn-f16"
JSON = "application/json"
# On every reply of an FFN shard or embed server (and the router's walk replies): the id of the
# vindex that answered (`larql_edge.service.identity.vindex_hash`). Replicas of a layer must agree.
VINDEX_HEADER = "x-larql-vindex"


__all__ = ["BINARY", "BINARY_F16", "JSON", "VINDEX_HEADER", "WireError"]
