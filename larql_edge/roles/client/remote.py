"""The remote providers, kept at their old import path: they live in `larql_edge.net.remote` now,
shared by the client (`larql generate`) and the serve role (a role never imports another role)."""

from larql_edge.net.remote import (  # noqa: F401
    BACKOFF_FIRST_S,
    BACKOFF_MAX_S,
    RemoteEmbed,
    RemoteError,
    RemoteFfn,
    RemoteHead,
    Replicas,
    Target,
    make_client,
    parse_targets,
)
