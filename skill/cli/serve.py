"""``archon-port serve``: run the MCP server over stdio (default) or streamable HTTP."""

from __future__ import annotations

import argparse
import logging

from skill.tools import DEFAULT_LOCK_TIMEOUT_S

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run the MCP server (stdio by default)",
        description="Serve every engine step as an MCP tool, confined to one workspace. Every call "
        "is recorded into a session file; replay it with `archon-port replay`.",
    )
    parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP on PORT instead of stdio")
    parser.add_argument(
        "--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1; anything else exposes the tools)"
    )
    parser.add_argument(
        "--workspace", metavar="DIR", help="project root holding archon_models/ (default: this project)"
    )
    parser.add_argument(
        "--session", metavar="FILE", help="session file to record into (default: .archon-port/sessions/serve-*.jsonl)"
    )
    parser.add_argument("--no-record", action="store_true", help="record no session")
    parser.add_argument(
        "--lock-timeout",
        type=float,
        default=DEFAULT_LOCK_TIMEOUT_S,
        metavar="S",
        help="seconds a call waits for a package another call is changing before it is refused "
        f"(default {DEFAULT_LOCK_TIMEOUT_S:g}; 0 refuses at once)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mcp_server.server import build_server

    server = build_server(
        args.workspace, session=args.session, record=not args.no_record, lock_timeout=args.lock_timeout
    )
    if args.http is None:
        logger.info("serving over stdio")
        server.run("stdio")
    else:
        logger.info("serving streamable HTTP on http://%s:%d/mcp", args.host, args.http)
        server.run("streamable-http", host=args.host, port=args.http)
    return 0
