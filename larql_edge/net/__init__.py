"""The network layer: what talks to another tier. The HTTP/1.1 clients of the hot path (`h1`,
`h1_sync`, `h1_async`), the one failure rule (`failures`) and the remote embed/FFN/head providers
with replica fail-over (`remote`) used by the attention-only client and larql-serve.

It sits below `service/` (the server toolkit, whose membership joins routers through these clients)
and above `wire/` and `format/`; it never imports a server.
"""
