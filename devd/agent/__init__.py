"""devd's agent runtime: the daemon carries out a session's actions itself.

Building blocks, each self-contained: `profiles` (agents.toml and the policy it sets), `http` (the one home of
httpx), `model` (the OpenAI-compatible chat-completions driver, streamed), `tools` (Read, Write, Exec, Git, Browse,
confined to a session's workspace), `kinds` (one module per kind of tool call, in one table: what the model is
offered, how the policy decides it, what is shown of it, how it is carried out), `sandbox` (bubblewrap, and the
containment of `sandbox = "none"`) and `runas` (who a command runs as).

Where bubblewrap is missing or cannot start
-------------------------------------------
With `sandbox = "auto"` (the default), devd tries bubblewrap once (`bwrap --ro-bind / / ... true`) the first time a
profile needs it. If `bwrap` is not installed, or cannot start here (inside some containers it fails with
"Failed to make / slave" or "No permissions to create new namespace"), devd does **not** fall back to running
commands unconfined: every `Exec` and `Git` call of that profile is refused, and the model is told why in a failed
result, for example: "commands cannot run: bubblewrap is not installed (no bwrap on the PATH), and [agent.coder]
sets sandbox = "auto"; install the bubblewrap package (Debian: apt-get install bubblewrap), or set sandbox = "none"
in [agent.coder] to run commands unconfined". `Read` and `Write` keep working (devd confines them itself, symlinks
included), and exec and git are not offered to the model as tools (the runner passes `exec_available=False` to the
model driver when `sandbox.choose` gives a `Refusal`). `sandbox = "bwrap"` refuses the same way; it differs from
"auto" only in saying that the profile requires bubblewrap. `sandbox = "none"` runs commands without bubblewrap
(still in the workspace, with a scrubbed environment, stdin closed, the timeout, the output cap and the limits, in a
pid namespace of its own so that nothing it starts outlives it): only for machines you would let the model use
anyway. It is refused where that pid namespace cannot be made.

Under bubblewrap a command sees the whole file system read-only except its workspace, a private `/tmp`, its own pid
namespace (it cannot see or signal the daemon's processes), and no network unless the profile says `network = true`.
Reads are not restricted: a command may read whatever its user may read. A command never runs as root: under a
daemon run as root it runs as the workspace's owner, or the profile's `run_as` (`runas`).
"""
