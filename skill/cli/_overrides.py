"""``--override key=value``: config attributes for the tiny HF config, values read as JSON when they parse."""

from __future__ import annotations

import argparse
import json
from typing import Any


def parse_override(text: str) -> tuple[str, Any]:
    """``clip_qkv=8.0`` -> ``("clip_qkv", 8.0)``; a value that is not JSON stays a string (``hidden_act=gelu``)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r}: write --override KEY=VALUE with a config attribute as KEY")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key, value


def add_override_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--override",
        dest="overrides",
        action="append",
        type=parse_override,
        default=[],
        metavar="KEY=VALUE",
        help="set a config attribute on the tiny HF config of both sides (repeatable; VALUE is JSON when it "
        "parses, e.g. clip_qkv=8.0, rope_parameters='{\"factor\": 2.0}', else a string)",
    )


def overrides_of(args: argparse.Namespace) -> dict[str, Any]:
    return dict(args.overrides)
