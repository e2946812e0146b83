"""Test and benchmark infrastructure, shared by ``tests/`` and ``benchmarks/`` (the roles never use it).

- `larql_edge.testing.servers`: real servers in a thread of this process, or as console-script processes;
- `larql_edge.testing.edge`: real nginx and varnishd in front of embed servers;
- `larql_edge.testing.hubserver`: a Hub-protocol server for the unmodified ``huggingface_hub`` client.
"""
