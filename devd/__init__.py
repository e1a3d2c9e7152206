"""devd: a session daemon for agent tools.

One compiled WebAssembly reasoning core, many sessions (one wasm instance each), stepped with events over
newline-delimited JSON-RPC on a Unix socket or TCP, and persisted so that nothing a client was answered is lost.
"""

from __future__ import annotations

__version__ = "0.1.0"
ABI = 2
# The core ABIs a module may speak: ABI 2 is ABI 1 with the generic Tool call, the same exports and every ABI-1 answer,
# snapshot and event read the same, so a module built for ABI 1 (`--core`) still runs, without Tool calls.
ABIS = (1, 2)
