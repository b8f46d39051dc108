"""MCP servers' tools for the model: the operator's ``mcp.json`` read and checked, the servers
connected at startup, their tools listed once and called by name.
"""
