"""larql-ffn: an FFN shard server for a contiguous range of layers (POST /v1/walk-ffn)."""
