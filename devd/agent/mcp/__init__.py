"""MCP tools: the broker that connects sessions to the MCP servers their profile (or their editor) names, through the
official MCP Python SDK. One module per responsibility: `broker` (the connections by configuration, and each session's
tools), `connection` (one server's supervisor task), `stdio` (a server process as a transport, bounded), `launch`
(how a stdio server's process is made under the sandbox), `names` (SERVER__TOOL), `results` (a result as the model
reads it). This package's `__init__` imports nothing, so the kinds table can name MCP tools without loading the SDK.
"""
