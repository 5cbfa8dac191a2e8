import sys

try:
    from skill.cli import main
except KeyboardInterrupt:  # Ctrl-C while the engine is still being imported
    sys.stderr.write("archon-port: interrupted\n")
    sys.exit(130)

sys.exit(main())
