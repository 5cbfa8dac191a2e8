"""``python -m mcp_server [--http PORT] [--workspace DIR]``: the same as ``archon-port serve``."""

import sys

from skill.cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
