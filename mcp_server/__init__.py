"""The MCP face of archon-port: engine steps as tools, the playbook as resources and a prompt."""

from mcp_server.server import build_server

__all__ = ["build_server"]
