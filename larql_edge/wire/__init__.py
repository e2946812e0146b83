"""Wire codecs: one module per format (DESIGN.md §1). `WireError` is what every decoder raises.

- `larql_edge.wire.embed`: the embed server's requests and responses (``/v1/embed``, ``/v1/logits``);
- `larql_edge.wire.ffn`: the FFN shard's ``/v1/walk-ffn``.

Every codec is little-endian and never trusts a length field without checking it against the body.
"""

# LARQL's binary content types, shared by the embed and FFN wires.
BINARY = "application/x-larql-ffn"
BINARY_F16 = "application/x-larql-ffn-f16"
JSON = "application/json"


class WireError(ValueError):
    """A malformed wire message (the server answers 400; a client treats the reply as garbage)."""


__all__ = ["BINARY", "BINARY_F16", "JSON", "WireError"]
