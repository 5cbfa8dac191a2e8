"""How the MCP server is started: its options, the bind rules and the HTTP token.

``archon-port serve`` (:mod:`skill.cli.serve`) and ``python -m mcp_server``
(:mod:`mcp_server.main`) take exactly these options, defined once here, and the HTTP
face (:mod:`mcp_server.http`) applies the same loopback and Host rules. They live in the
engine so that the two faces share them without importing each other.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import secrets
from collections.abc import Mapping

from skill.console import add_verbose_option
from skill.tools import DEFAULT_LOCK_TIMEOUT_S

logger = logging.getLogger(__name__)

TOKEN_ENV = "ARCHON_PORT_TOKEN"
MIN_TOKEN_LENGTH = 16
DESCRIPTION = (
    "Serve every engine step as an MCP tool, confined to one workspace. Every call "
    "is recorded into a session file; replay it with `archon-port replay`. Over HTTP every "
    f"request needs 'Authorization: Bearer <token>': the token printed at start, or ${TOKEN_ENV}."
)
_LOOPBACK_NAMES = frozenset({"localhost"})


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only: 127.0.0.0/8, ::1 or ``localhost``, in any case."""
    if host.lower().rstrip(".") in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_header_name(host: str) -> str:
    """``host`` as a client writes it in a Host header: lowercase, an IPv6 address in brackets."""
    bare = host.strip("[]").lower()
    try:
        return f"[{bare}]" if ipaddress.ip_address(bare).version == 6 else bare
    except ValueError:
        return bare.rstrip(".")


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
        "serving on %s:%d with --allow-remote: any host that reaches it and holds the token can run the tools; "
        "the Host/Origin (DNS rebinding) checks are off",
        host,
        port,
    )


def server_token(environ: Mapping[str, str] = os.environ) -> tuple[str, bool]:
    """The HTTP bearer token: ``$ARCHON_PORT_TOKEN`` when set, else a new random one; and
    whether it was made here (then it is printed at start, as notebook servers print theirs)."""
    given = environ.get(TOKEN_ENV)
    if given is None:
        return secrets.token_urlsafe(32), True
    token = given.strip()
    if len(token) < MIN_TOKEN_LENGTH or any(c.isspace() or not c.isprintable() for c in token):
        raise ValueError(
            f"{TOKEN_ENV} must hold at least {MIN_TOKEN_LENGTH} printable characters and no space; "
            "unset it and the server makes one"
        )
    return token, False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The serve options, shared by ``archon-port serve`` and ``python -m mcp_server``."""
    parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP on PORT instead of stdio")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="HTTP bind address (default 127.0.0.1; any loopback address keeps the Host/Origin checks on, "
        "anything else exposes the tools and needs --allow-remote)",
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


def build_parser(prog: str = "python -m mcp_server") -> argparse.ArgumentParser:
    """A stand-alone parser of the serve options (``python -m mcp_server``)."""
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION + " The same as `archon-port serve`.")
    add_verbose_option(parser)
    add_arguments(parser)
    return parser


def parse_args(argv: list[str], prog: str = "python -m mcp_server") -> argparse.Namespace:
    """Parse the serve options; a leading ``serve`` (as in ``archon-port serve ...``) is accepted."""
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    return build_parser(prog).parse_args(argv)
