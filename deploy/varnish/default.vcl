vcl 4.1;
# Varnish in front of one or more larql-embed servers (DESIGN.md §2, docs/edge-cache.md).
#
# What it does
#   * Caches only the immutable row lookups, GET/HEAD of
#       /v1/embed/{id}[.json]                   (the default model, or the one X-Model-Id names)
#       /v1/{model_id}/embed/{id}[.json]        (model named in the path)
#       /v1/models/{sha256}/embed/{id}[.json]   (content-addressed: pinned to the weights)
#     The hash holds a normalised Accept (exactly two classes, "bin" and "json"), so the binary and
#     the JSON representation of one row are never mixed. Everything else (POST /v1/embed,
#     POST /v1/logits, /v1/token/*, /v1/stats, /v1/health, /v1/ready, /metrics) is passed, never cached.
#   * Concurrent misses of one key are collapsed by Varnish's waiting list (one backend fetch);
#     backend connections are kept alive (Varnish's default); cached rows are served while the
#     backends are down (grace, driven by the health probe); If-None-Match on a cached row gets a
#     304 from the cache (Varnish compares it with the stored ETag itself).
#   * Says X-Cache: HIT or MISS on the cacheable routes.
#   * Errors Varnish produces itself leave as {"error": "..."} like the server's own.
#
# How to run it
#     varnishd -F -a :6081 -f /etc/varnish/default.vcl -s malloc,256m
#     varnishd -C -f /etc/varnish/default.vcl        # compile check only
#   Unprivileged (no root): add `-j none -n /some/writable/dir`. As root, Varnish drops to its own
#   users (`-j unix`, the default), which then need read access to this file.
#   Size -s for the rows you expect to keep: a row is hidden * 4 bytes in binary, ~4x that as JSON,
#   plus ~1 KB of object overhead (Gemma 3 270M, hidden 640: ~3.5 KB binary, ~14 KB JSON).
#
# What to change for a deployment (the tests rewrite exactly these, nothing else)
#   * `.host` / `.port` of the backend below; for more embed servers copy the backend block
#     (embed2, embed3, ...) and add each to the director in vcl_init. All must serve the same models:
#     the unprefixed URLs do not say which weights they mean.
#   * the listen address is varnishd's -a flag, not part of this file.

import std;
import directors;

# A backend is healthy while /v1/ready answers 200: a server still loading its models (503) takes
# no traffic, and a dead one is noticed within a few seconds. While no backend is healthy, cached
# rows are served for as long as their grace lasts (vcl_recv).
probe larql_ready {
    .url = "/v1/ready";
    .expected_response = 200;
    .interval = 2s;
    .timeout = 1s;
    .window = 5;
    .threshold = 3;
    .initial = 2;                 # healthy after the first good poll when Varnish starts
}

backend embed1 {
    .host = "127.0.0.1";
    .port = "8082";
    .probe = larql_ready;
    .connect_timeout = 2s;        # origins are near: a connect that hangs is a dead origin
    .first_byte_timeout = 60s;    # a batched lm_head product on a large model can take a while
    .between_bytes_timeout = 10s;
    .max_connections = 512;       # bounded: beyond it requests fail fast instead of piling up
}

sub vcl_init {
    # Spreads misses and passes over the embed servers; skips sick ones.
    new larql = directors.round_robin();
    larql.add_backend(embed1);
}

sub vcl_recv {
    set req.backend_hint = larql.backend();
    unset req.http.X-Larql-Rep;   # internal marker: never taken from a client

    # Only GET/HEAD of the row URLs are cacheable; everything else goes to a backend every time,
    # its body streamed through. Bodies up to the server's published limit pass (GET /v1/stats ->
    # limits.max_body_bytes, --max-body, 1 MiB by default): keep this number equal to it. Above it
    # the server would answer 413 before reading the body, and Varnish, still sending, would turn
    # that into a backend error; so the 413 is given here, in the server's envelope.
    if (std.integer(req.http.Content-Length, 0) > 1048576) {
        return (synth(413, "request body too large: the embed server's limit is 1048576 bytes"));
    }
    if (req.method != "GET" && req.method != "HEAD") {
        return (pass);
    }
    if (req.url !~ "^/v1/(models/[0-9A-Fa-f]{64}/|[A-Za-z0-9][A-Za-z0-9._-]*/)?embed/[0-9]+(\.json)?(\?.*)?$") {
        return (pass);            # /metrics, /v1/health, /v1/ready, /v1/stats, /v1/token/*, ...
    }

    # The row depends on none of these: drop them so they can't split the cache.
    set req.url = regsub(req.url, "\?.*$", "");
    unset req.http.Cookie;
    if (req.url !~ "^/v1/embed/") {
        # Only the unprefixed URL picks its model by X-Model-Id (the server then answers
        # `Vary: Accept, X-Model-Id`); the other spellings name the model in the path.
        unset req.http.X-Model-Id;
    }

    # Accept normalisation, exactly two classes: "json" when Accept asks for application/json (q
    # above 0) and not for the binary type; else "bin" (the server's default). The .json spelling
    # is JSON whatever Accept says.
    if (req.url ~ "\.json$") {
        set req.http.X-Larql-Rep = "json";
    } elsif (req.http.Accept ~ "(?i)application/x-larql-ffn(?!-)(?!\s*;\s*q\s*=\s*0(\.0*)?\s*(,|$))") {
        set req.http.X-Larql-Rep = "bin";
    } elsif (req.http.Accept ~ "(?i)application/json(?!\s*;\s*q\s*=\s*0(\.0*)?\s*(,|$))") {
        set req.http.X-Larql-Rep = "json";
    } else {
        set req.http.X-Larql-Rep = "bin";
    }
    # The backend is asked for exactly that representation, and the server's `Vary: Accept` then
    # matches on the normalised value: two variants per row, never one per Accept spelling.
    if (req.http.X-Larql-Rep == "json") {
        set req.http.Accept = "application/json";
    } else {
        set req.http.Accept = "application/x-larql-ffn";
    }

    # Grace: while a backend is healthy, an expired row is refreshed almost at once; while none is,
    # the full grace set in vcl_backend_response applies and cached rows keep being served.
    if (std.healthy(req.backend_hint)) {
        set req.grace = 10s;
    }
    return (hash);                # skips the built-in rules (which would pass on Authorization)
}

sub vcl_hash {
    # Path + representation (+ model header for the unprefixed URL). Not Host: the row does not
    # depend on the name the client used.
    hash_data(req.url);
    hash_data(req.http.X-Larql-Rep);
    if (req.url ~ "^/v1/embed/" && req.http.X-Model-Id) {
        hash_data(req.http.X-Model-Id);
    }
    return (lookup);
}

sub vcl_backend_fetch {
    unset bereq.http.X-Larql-Rep; # internal marker: not for the backend
}

sub vcl_backend_response {
    if (bereq.uncacheable) {
        return (deliver);         # a pass (POST, /metrics, ...): never stored
    }
    if (beresp.status == 200 && beresp.http.Cache-Control ~ "immutable") {
        # TTL comes from the server's max-age (one year). Grace lets a row outlive its TTL while
        # the backends are down; keep holds it for revalidation (If-None-Match to the backend).
        set beresp.grace = 30d;
        set beresp.keep = 30d;
        return (deliver);
    }
    # Anything else on a row URL (404 out of range or unknown sha, 503 while loading) is not
    # stored. A short hit-for-miss keeps waiting requests from being serialised behind it.
    set beresp.ttl = 1s;
    set beresp.grace = 0s;
    set beresp.uncacheable = true;
    return (deliver);
}

sub vcl_backend_error {
    # No backend reachable (or it failed mid-response) and nothing cached: the server's envelope.
    set beresp.status = 503;
    set beresp.http.Content-Type = "application/json";
    set beresp.http.Cache-Control = "no-store";
    set beresp.http.Retry-After = "5";
    # (A {"..."} string ends at the first quote-brace, hence the closing brace added apart.)
    set beresp.body = {"{"error": "embed server unavailable: no cached copy and no origin reachable""} + "}" + {"
"};
    set beresp.ttl = 0s;
    set beresp.grace = 0s;
    set beresp.uncacheable = true;
    return (deliver);
}

sub vcl_synth {
    # Responses Varnish makes up itself, in the server's envelope.
    set resp.http.Content-Type = "application/json";
    set resp.http.Cache-Control = "no-store";
    set resp.body = {"{"error": ""} + regsuball(resp.reason, {"["\\]"}, "") + {"""} + "}" + {"
"};
    return (deliver);
}

sub vcl_deliver {
    if (req.http.X-Larql-Rep) {
        # obj.hits counts deliveries from the stored object: a request that waited for another's
        # fetch (collapsed) or got a row in grace counts as a HIT too.
        if (obj.hits > 0) {
            set resp.http.X-Cache = "HIT";
        } else {
            set resp.http.X-Cache = "MISS";
        }
    }
    unset resp.http.X-Varnish;    # internal transaction ids
    unset resp.http.Via;
}
