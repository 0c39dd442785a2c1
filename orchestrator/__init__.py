"""weightsync: push trainer weights into inference engines, finalized exactly once per version.

Layers (docs/ARCHITECTURE.md): `orchestrator.core` (the pure state machine),
`orchestrator.daemon` (the service around it), `orchestrator.trainer` (what a trainer
imports), `orchestrator.cli` (the `weightsync` command).
"""

__version__ = "0.2.0"
