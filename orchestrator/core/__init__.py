"""The daemon's pure core: events in, commands out. No I/O, no clock reads, no threads.

`Core.handle(event, now) -> Result` (machine.py); the state table is table.py; the
triggers are sync.py (a trainer's sync), fleet.py (engines) and clock.py (deadlines and
recovery); what they share is model.py.
"""

from orchestrator.core import commands, events
from orchestrator.core.commands import Result
from orchestrator.core.machine import Core
from orchestrator.core.records import EngineRecord, GroupRecord, Limits, Spooled, SyncRecord
from orchestrator.core.states import ACTIVE, EngineState, State

__all__ = [
    "ACTIVE",
    "Core",
    "EngineRecord",
    "EngineState",
    "GroupRecord",
    "Limits",
    "Result",
    "Spooled",
    "State",
    "SyncRecord",
    "commands",
    "events",
]
