"""The archon-port playbook engine: each porting step is a typed, idempotent function."""

__version__ = "0.1.0"
