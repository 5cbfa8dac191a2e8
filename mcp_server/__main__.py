"""``python -m mcp_server [serve] [--http PORT] [--workspace DIR] ...``: the same as ``archon-port serve``.

The options are the engine's (:mod:`skill.serving`), shared with ``archon-port serve``; a
leading ``serve`` is accepted, so both spellings work.
"""

import sys

from mcp_server.main import main

sys.exit(main(sys.argv[1:]))
