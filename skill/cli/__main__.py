import sys

from skill.cli import main

sys.exit(main())
