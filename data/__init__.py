"""Data pipeline: the .bin shard format, the rank-sharded loader, download and tokenize CLIs."""
