"""`devd acp`: an Agent Client Protocol (v1) agent on stdin/stdout that is a thin face on the daemon's sessions.

`wire` is ACP's JSON-RPC and its messages (no I/O), `translate` turns the daemon's notices into ACP `session/update`s
(pure), `bridge` is the process: the editor on one side, a `devd.client.AsyncClient` on the other, and `main` its
command line. Everything durable is the daemon's; this process keeps only what it derives from the daemon's notices.
"""
