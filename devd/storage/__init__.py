"""The storage layer: what devd needs from durable storage, and its SQLite, PostgreSQL and memory backends."""
