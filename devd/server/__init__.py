"""The wire layer: listeners, connections, JSON-RPC framing, dispatch and the method handlers."""
