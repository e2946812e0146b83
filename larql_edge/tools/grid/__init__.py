"""The grid: membership of running roles with a router, and `larql-grid up` (local processes)."""
