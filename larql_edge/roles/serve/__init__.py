"""larql-serve: an OpenAI-compatible front door for the grid, with continuous batching."""
