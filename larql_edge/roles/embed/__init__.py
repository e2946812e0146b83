"""The embed server (ADR-0008): embeddings f16 at rest, the lm_head, and the tokenizer over HTTP.

- `larql_edge.roles.embed.app.create_app` builds the Sanic app (one per worker process);
- `larql_edge.roles.embed.cli.main` is the ``larql-embed`` console script.

Nothing heavy is imported here: the CLI must set up the environment (BLAS threads, Prometheus
multiprocess folder) before numpy or prometheus_client load.
"""
