"""What is wrong with a job's data, said before torch is imported: a file that is not there."""

from __future__ import annotations

from pathlib import Path

from ...errors import AutopipeError

__all__ = ["DataError", "check_data_path"]


class DataError(AutopipeError):
    """--data does not exist, is empty, or does not fit the model's inputs."""


def check_data_path(path: Path, *, flag: str = "--data") -> None:
    if not path.exists():
        raise DataError(f"{flag} {str(path)!r} does not exist.")
    if path.is_file() and path.stat().st_size == 0:
        raise DataError(f"{flag} {str(path)!r} is empty.")
