"""``archon-port serve``: run the MCP server over stdio (default) or streamable HTTP.

The options are :mod:`skill.serving`'s, the same ``python -m mcp_server`` takes. The server
is the other face: it is imported only when this command runs, so the CLI never imports
``mcp_server`` otherwise.
"""

from __future__ import annotations

import argparse

from skill.serving import DESCRIPTION, add_arguments


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="run the MCP server (stdio by default)", description=DESCRIPTION)
    add_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mcp_server.main import run as serve

    return serve(args)
