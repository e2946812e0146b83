"""Every error larql-edge raises on purpose: one tree, rooted at `LarqlError`.

Each class declares what it means at both boundaries:

- ``status``: the HTTP status a server answers with when the error reaches a handler (4xx: the
  caller's mistake; 5xx: ours or a dependency's). `larql_edge.service` turns any `LarqlError` into
  ``{"error": message}`` with this status; anything else is a bug (500, details only in the log).
- ``exit_code``: the exit status of a command-line tool that stops on it (after one line on stderr,
  never a traceback; argparse's usage errors exit 2, Ctrl-C 130).
- ``kind``: a short label for metrics (``larql_<role>_errors_total{type}``) and logs.

Foreign errors (OSError, gguf-py, huggingface_hub, sockets) are translated into these once, at the
boundary where they happen (`larql_edge.tools.slicer.hub` for the Hub, the HTTP clients for sockets).
"""

from __future__ import annotations


class LarqlError(Exception):
    """Base of every error larql-edge raises on purpose."""

    status = 500
    exit_code = 1
    kind = "internal"

    def __init__(self, message: str = ""):
        super().__init__(message)
        self.message = message


# -- HTTP-shaped errors: a request that cannot be served ------------------------------------------


class BadRequest(LarqlError):
    status, kind = 400, "bad_request"


class Unauthorized(LarqlError):
    status, kind = 401, "unauthorized"


class Forbidden(LarqlError):
    status, kind = 403, "forbidden"


class NotFound(LarqlError):
    status, kind = 404, "not_found"


class MethodNotAllowed(LarqlError):
    status, kind = 405, "method_not_allowed"


class NotAcceptable(LarqlError):
    status, kind = 406, "not_acceptable"


class Conflict(LarqlError):
    """The request contradicts the current state (e.g. a member that does not fit the grid)."""

    status, kind = 409, "conflict"


class PayloadTooLarge(LarqlError):
    status, kind = 413, "payload_too_large"


class UnsupportedMediaType(LarqlError):
    status, kind = 415, "unsupported_media_type"


class TooManyRequests(LarqlError):
    """Over capacity: the caller may retry after ``retry_after`` seconds."""

    status, kind = 429, "too_many_requests"

    def __init__(self, message: str = "", retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class BadGateway(LarqlError):
    """A dependency answered with an error or garbage."""

    status, kind = 502, "bad_gateway"


class ServiceUnavailable(LarqlError):
    """A dependency is down, or this service is not loaded yet (or is draining)."""

    status, kind = 503, "unavailable"


class GatewayTimeout(LarqlError):
    status, kind = 504, "timeout"


# -- wire formats and protocols: a malformed message is the sender's mistake ----------------------


class WireError(BadRequest):
    """A malformed wire message (a server answers 400; a client treats such a reply as garbage)."""

    kind = "wire"


class ProtocolError(BadRequest):
    """A grid membership message (join, heartbeat, leave) that does not follow the protocol."""

    kind = "protocol"


# -- artefacts: vindexes, extraction sources, slices, the Hub -------------------------------------


class VindexError(LarqlError):
    """A vindex folder is missing, malformed, or corrupt (a server that cannot load one is unavailable)."""

    status, kind = 503, "vindex"


class ChecksumMismatch(VindexError):
    """One or more files do not match the sha256 recorded in index.json."""

    kind = "checksum"

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


class QuantError(VindexError):
    """Bad input to a block codec (shape, size, non-finite values, unknown format)."""

    kind = "quant"


class KernelError(LarqlError, ValueError):
    """A compact matrix or an input to it is malformed (wrong format, shape, dtype or size): a bug of
    the caller inside larql-edge, since weights are validated when a vindex is read."""

    kind = "kernel"


class SourceError(LarqlError):
    """An extraction source (GGUF, Hugging Face folder, packaged alias) cannot be used."""

    kind = "source"


class UnsupportedArchitecture(SourceError):
    """The model's architecture is not one of the families larql-edge describes."""

    kind = "unsupported_architecture"


class UnsupportedTensorType(SourceError):
    """A GGUF tensor is stored in a quantization type we cannot read."""

    kind = "unsupported_tensor_type"


class SetupError(LarqlError):
    """The machine or container cannot host the process as configured (e.g. no writable folder)."""

    exit_code, kind = 2, "setup"


class OutputExists(LarqlError):
    """The output folder exists and --force was not given (or it is not ours to replace)."""

    kind = "output_exists"


class SliceError(LarqlError):
    """A slice request is invalid (unknown preset or part, bad destination)."""

    kind = "slice"


class HubError(LarqlError):
    """A Hub operation failed; the subclasses say how (status: what the Hub answered)."""

    status, kind = 502, "hub"


class HubNotFound(HubError):
    status, kind = 404, "hub_not_found"


class HubRevisionNotFound(HubNotFound):
    kind = "hub_revision_not_found"


class HubUnauthorized(HubError):
    """No token, or a token the Hub refused (401)."""

    status, kind = 401, "hub_unauthorized"


class HubForbidden(HubError):
    """The token is valid but may not do this (403)."""

    status, kind = 403, "hub_forbidden"


class HubGated(HubForbidden):
    """A gated repo whose conditions this account has not accepted."""

    kind = "hub_gated"


class HubRateLimited(HubError):
    status, kind = 429, "hub_rate_limited"


class HubUnavailable(HubError):
    """The Hub could not be reached, or answered 5xx."""

    status, kind = 503, "hub_unavailable"


class HubInvalid(HubError):
    """A bad repo id or an unsafe remote listing: refused before anything is written."""

    status, kind = 400, "hub_invalid"


# -- the network between tiers ---------------------------------------------------------------------


class TransportError(LarqlError):
    """No reply: the server could not be reached, the connection broke, or it timed out."""

    status, kind = 502, "transport"


class ConnectFailed(TransportError):
    kind = "connect_failed"


class TimedOut(TransportError):
    status, kind = 504, "timed_out"


class MemberSilent(TimedOut):
    """A member stopped heartbeating while a request to it was in flight (SIGSTOP, a hung host)."""

    kind = "member_silent"


class Stalled(TimedOut):
    """No reply within the bound learned from recent hops of the same size (far beyond any of them):
    a frozen replica (SIGSTOP, a paused VM). The client gives up on it and fails over."""

    kind = "stalled"


class Superseded(TransportError):
    """The other request of a hedged hop answered first: this one was abandoned (not a failure of
    its server)."""

    kind = "superseded"


class ConnectionLost(TransportError):
    kind = "connection_lost"


class MalformedReply(TransportError):
    """The reply is not HTTP/1.1 we can read: a malformed status line, header or chunk framing, an
    invalid Content-Length, or a head larger than the clients accept."""

    kind = "malformed_reply"


class ReplyTooLarge(MalformedReply):
    """The reply's body is larger than the caller's ``max_body``; nothing past the bound was read."""

    kind = "reply_too_large"


class RemoteError(LarqlError):
    """A remote tier could not answer (after retries), or answered something unusable."""

    status, kind = 502, "remote"


def all_errors() -> list[type[LarqlError]]:
    """Every class of the tree (for the tests that check each declares a sane status)."""
    out: list[type[LarqlError]] = []
    todo: list[type[LarqlError]] = [LarqlError]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out
