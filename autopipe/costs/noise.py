"""Whether a profile's times hold as a promise: the short note said beside every predicted step.

A plan's step is a sum of its profile's times, so a profile measured while other work ran promises
a step the job will not see: a small model profiled at load 4 on 2 cores planned 1,581 ms, and its
job ran 210 ms (issue 41), with nothing beside the number to say so. The profiler keeps, in
figures, how disturbed its timings were (``Profile.timing_spread``, ``twin_ratio``, ``host_load``,
and each layer's ``forward_spread`` / ``backward_spread``); this module judges them in one place,
so that convert, the job's README, report.html and the step log say the same words beside the same
number. Torch-free: the planner carries the note into the plan (``Plan.profile_noise``), which is
how a rank's step log learns it.

Example:
    >>> from dataclasses import replace
    >>> from autopipe.costs.layer_costs import Profile
    >>> quiet = Profile.from_costs([1.0, 2.0])
    >>> noise_note(quiet)
    ''
    >>> noise_note(replace(quiet, timing_spread=0.35, twin_ratio=1.6))
    'runs spread 35%, identical layers 1.6x apart'
    >>> noisy_phrase("runs spread 35%")
    'noisy profile: runs spread 35%'
"""

from __future__ import annotations

from .layer_costs import Profile

__all__ = ["NOISY_LOAD", "NOISY_SPREAD", "NOISY_TWINS", "noise_note", "noisy_phrase"]

# Twice measure.TARGET_SPREAD (10%, the spread the profiler repeats runs to reach): where the profiler
# already warns that a layer's, or the whole model's, timings stayed noisy.
NOISY_SPREAD = 0.20
# profiler.DISAGREE: identical layers this far apart were timed while something else ran.
NOISY_TWINS = 1.25
# Load beyond the profiler's own threads, per core: with half a core's worth of other work every
# timing shares a core part of the time (2 cores, 1 thread: a load above 2.0).
NOISY_LOAD = 0.5


def noise_note(profile: Profile) -> str:
    """What makes ``profile``'s times doubtful, in a few words ("" when nothing does): the runs'
    spread (the whole model's, or the layers' together, whichever is larger) over ``NOISY_SPREAD``,
    identical layers more than ``NOISY_TWINS`` apart, or (a CPU profile) other work on the host's
    cores beyond ``NOISY_LOAD`` a core."""
    parts = []
    spread = max(profile.timing_spread, _layers_spread(profile))
    if spread > NOISY_SPREAD:  # an interquartile range over the median; past 1 a ratio reads better
        parts.append(f"runs spread {spread:.0%}" if spread < 1 else f"runs spread {spread:.1f}x their median")
    if profile.twin_ratio > NOISY_TWINS:
        parts.append(f"identical layers {profile.twin_ratio:.1f}x apart")
    device = profile.device
    if device.type == "cpu" and device.cores > 0 and profile.host_load > 0:
        own = min(max(device.threads, 1), device.cores)  # the profiler's own threads are part of the load
        if profile.host_load - own > NOISY_LOAD * device.cores:
            parts.append(f"load {profile.host_load:.1f} on {device.cores} cores")
    return ", ".join(parts)


def noisy_phrase(note: str) -> str:
    """The words set beside a predicted step: ``noisy profile: <note>``, or "" for a quiet one."""
    return f"noisy profile: {note}" if note else ""


def _layers_spread(profile: Profile) -> float:
    """The layers' interquartile ranges together over their times together (each timed alone): how
    uncertain their sum, the step's raw material, is; layers a profile gives no spread for count nothing."""
    timed = [l for l in profile.layers if l.forward_spread + l.backward_spread > 0]
    total = sum(l.forward_time + l.backward_time for l in timed)
    return sum(l.forward_spread + l.backward_spread for l in timed) / total if total > 0 else 0.0
