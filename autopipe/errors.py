"""One error family: every failure a user can fix is an AutopipeError with the values and a hint.

The CLI prints such errors as one line and exits 1; set AUTOPIPE_DEBUG=1 to see the traceback.
"""

from __future__ import annotations

__all__ = [
    "AutopipeError",
    "TraceError",
    "TraceMismatchError",
    "InputMismatchError",
    "ModelNotFoundError",
    "PartitionError",
    "InfeasibleMemoryError",
    "StaleProfileError",
    "RecordError",
    "ExportError",
]


class AutopipeError(ValueError):
    """Base class: a problem with the user's input that the message explains how to fix."""


class TraceError(AutopipeError):
    """The model could not be traced into a graph."""


class TraceMismatchError(TraceError):
    """The traced graph does not reproduce the eager model's outputs."""


class InputMismatchError(AutopipeError):
    """Inputs given to a flattened sequence differ in structure from those it was traced with."""


class ModelNotFoundError(AutopipeError):
    """A model name, folder or factory could not be resolved."""


class PartitionError(AutopipeError):
    """The partition asked for cannot be made (too many stages, bad boundaries, ...)."""


class InfeasibleMemoryError(PartitionError):
    """No partition fits the memory limit."""


class StaleProfileError(AutopipeError):
    """A profile or plan does not belong to the model/flatten options it is used with."""


class RecordError(AutopipeError):
    """A saved record (profile.json, plan.json) is unreadable or of an unknown schema."""


class ExportError(AutopipeError):
    """A plan cannot be written for the engine asked (a cut inside a module, a schedule it lacks, ...)."""
