"""larql-router: one front door for the grid (FFN layer routing, embed proxy, membership)."""
