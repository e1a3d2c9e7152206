"""devd: a session daemon for agent tools.

One compiled WebAssembly reasoning core, many sessions (one wasm instance each), stepped with events over
newline-delimited JSON-RPC on a Unix socket or TCP, and persisted so that nothing a client was answered is lost.
"""

from __future__ import annotations

__version__ = "0.1.0"
ABI = 1
