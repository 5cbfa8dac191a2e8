"""``archon-port serve``: run the MCP server over stdio (default) or streamable HTTP."""

from __future__ import annotations

import argparse
import ipaddress
import logging

from skill.cli._errors import reports_bad_input
from skill.tools import DEFAULT_LOCK_TIMEOUT_S

logger = logging.getLogger(__name__)

_LOOPBACK_NAMES = {"localhost"}


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, port: int, allow_remote: bool) -> None:
    """Refuse a port out of range, and a non-loopback host unless ``allow_remote``; warn when allowed."""
    if not 0 < port < 65536:
        raise ValueError(f"--http {port} is not a TCP port; pick one from 1 to 65535.")
    if is_loopback(host):
        return
    if not allow_remote:
        raise ValueError(
            f"--host {host} would expose every tool (which writes files) beyond this machine and turn off the "
            "Host/Origin checks; pass --allow-remote as well if you mean it."
        )
    logger.warning(
        "serving on %s:%d with --allow-remote: any host that reaches it can run the tools; "
        "the Host/Origin (DNS rebinding) checks are off",
        host,
        port,
    )


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
        "--allow-remote",
        action="store_true",
        help="allow a --host that is not loopback (anyone who reaches it can run the tools)",
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


@reports_bad_input
def run(args: argparse.Namespace) -> int:
    from mcp_server.server import build_server
    from skill.codemod.workspace import Workspace
    from skill.session import open_records

    if args.http is not None:
        check_bind(args.host, args.http, args.allow_remote)
    workspace = Workspace(args.workspace)
    if args.session and not args.no_record:
        open_records(args.session)  # a corrupt or closed session is refused before serving
    server = build_server(
        workspace, session=args.session, record=not args.no_record, lock_timeout=args.lock_timeout
    )
    if args.http is None:
        logger.info("serving over stdio")
        server.run("stdio")
    else:
        logger.info("serving streamable HTTP on http://%s:%d/mcp", args.host, args.http)
        server.run("streamable-http", host=args.host, port=args.http)
    return 0
