"""``python -m mcp_server [serve] [--http PORT] [--workspace DIR] ...``: the same as ``archon-port serve``.

The options are ``archon-port serve``'s own (:mod:`skill.cli.serve`); a leading ``serve``
is accepted, so both spellings work.
"""

import sys

from skill.cli.serve import main

sys.exit(main(sys.argv[1:]))
