"""Start the MCP server from a shell: ``python -m mcp_server`` and ``archon-port serve``.

The options and the bind and token rules are the engine's (:mod:`skill.serving`), so the
CLI's ``serve`` command parses the same ones and hands its arguments to :func:`run`
(importing this module only when it runs: the faces do not import each other otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
from collections.abc import Iterator
from types import FrameType

from mcp_server.server import build_server
from skill.codemod.workspace import Workspace
from skill.console import (
    EXIT_INTERRUPTED,
    INTERRUPTED_LINE,
    configure_logging,
    interrupted,
    reports_bad_input,
    sigterm_unwinds,
)
from skill.serving import TOKEN_ENV, check_bind, host_header_name, parse_args, server_token
from skill.session import open_records

logger = logging.getLogger(__name__)


@reports_bad_input
def run(args: argparse.Namespace) -> int:
    """Serve over stdio, or streamable HTTP with ``--http PORT``, until interrupted."""
    token = ""
    generated = False
    if args.http is not None:
        check_bind(args.host, args.http, args.allow_remote)
        token, generated = server_token()
    workspace = Workspace(args.workspace)
    if args.session and not args.no_record:
        open_records(args.session)  # a corrupt or closed session is refused before serving
    server = build_server(workspace, session=args.session, record=not args.no_record, lock_timeout=args.lock_timeout)
    with _interrupt_raises():
        if args.http is None:
            logger.info("serving over stdio")
            server.run("stdio")
        else:
            url = f"http://{host_header_name(args.host)}:{args.http}/mcp"
            if generated:
                logger.info("serving streamable HTTP on %s; clients send 'Authorization: Bearer %s'", url, token)
            else:
                logger.info("serving streamable HTTP on %s; clients send 'Authorization: Bearer $%s'", url, TOKEN_ENV)
            server.serve_http(args.host, args.http, token)
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m mcp_server") -> int:
    """``python -m mcp_server``: as ``archon-port serve``, with its one-line endings (Ctrl-C: exit 130)."""
    args = parse_args(sys.argv[1:] if argv is None else list(argv), prog)
    configure_logging(args.verbose)
    try:
        with sigterm_unwinds():
            return run(args)
    except BaseException as error:
        if not interrupted(error):
            raise
        sys.stderr.write(INTERRUPTED_LINE)
        return EXIT_INTERRUPTED


@contextlib.contextmanager
def _interrupt_raises() -> Iterator[None]:
    """Ctrl-C raises ``KeyboardInterrupt`` wherever the server is, so the command always ends
    with its one interrupt line and exit 130.

    asyncio's runner would otherwise turn SIGINT into a cancellation of the server task,
    which the server may finish as a normal shutdown (exit 0), depending on where the
    signal lands. A handler of our own (not ``signal.default_int_handler``) is left alone
    by the runner."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
