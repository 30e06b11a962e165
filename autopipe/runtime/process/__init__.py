"""How a rank starts, where it runs and how it stops: its device and process groups, every
collective it makes, train.py's flags, launching local workers, and one error line from rank 0.

The names below are imported on first use."""

from __future__ import annotations

from ...lazy import lazy_exports

_NAMES = {
    "Comm": "comm",
    "DeviceCheckError": "comm",
    "HostSyncError": "comm",
    "checking_requested": "comm",
    "DistEnv": "distenv",
    "init_dist": "distenv",
    "rank_device": "distenv",
    "to_device": "distenv",
    "describe": "failures",
    "error_log_path": "failures",
    "write_traceback": "failures",
    "FlagError": "flags",
    "float_pair": "flags",
    "parse_flags": "flags",
    "suggest_flag": "flags",
    "RUN_COMMAND": "launch",
    "launch_command": "launch",
    "launch_nodes": "launch",
    "run_local_workers": "launch",
    "check_launch": "lifecycle",
    "one_line_errors": "lifecycle",
    "watch_peers": "lifecycle",
}
__all__ = sorted(_NAMES)
__getattr__ = lazy_exports(__name__, _NAMES, globals())
