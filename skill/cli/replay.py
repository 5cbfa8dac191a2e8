"""``archon-port replay SESSION``: re-run a recorded session in a fresh copy and compare."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from skill.console import reports_bad_input

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "replay",
        help="replay a recorded session in a temporary copy of the repo",
        description="Re-run every call of SESSION in a fresh temporary copy of the repository, "
        "rebuilt to the state the session started from. Exits 1 naming the first call or file "
        "that differs.",
    )
    parser.add_argument("session", type=Path, help="session file (JSON Lines)")
    parser.add_argument("--source", type=Path, help="repository to copy (default: this project)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copy and print its path")
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let recorded calls that set trust_remote_code run a checkpoint's own Python code "
        "(refused by default: a session file is untrusted input)",
    )
    parser.add_argument(
        "--close",
        action="store_true",
        help="first close the session (capturing edits made outside the tools since its last call)",
    )
    parser.add_argument(
        "--rerecord",
        action="store_true",
        help="re-record the session on this engine after a change altered what its calls write (a hand "
        "port's files): takes differences in results and files, stops on a changed outcome or a hand edit "
        "that no longer applies; replaces SESSION and writes the files it created into the repository",
    )
    parser.set_defaults(func=run)


@reports_bad_input
def run(args: argparse.Namespace) -> int:
    from skill.replay import ReplayInput, replay_session
    from skill.session import SessionRecorder

    if args.close:
        SessionRecorder(args.session, args.source).close()
    request = ReplayInput(
        session=args.session,
        source=args.source,
        keep=args.keep,
        trust_remote_code=args.trust_remote_code,
        rerecord=args.rerecord,
    )
    report = replay_session(request)
    sys.stdout.write(report.describe() + "\n")
    if report.kept_copy is not None:
        sys.stdout.write(f"copy kept at {report.kept_copy}\n")
    return 0 if report.ok else 1
