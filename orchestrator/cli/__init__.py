"""The `weightsync` command: may import anything; nothing imports it."""

from orchestrator.cli.main import command, main

__all__ = ["command", "main"]
