"""Progress a person sees while a long pass runs: one small record the passes call, shown one way.

A pass that takes long (profiling each layer, the runtime reserve's probe, the cluster search)
reports phases and nothing else; it never prints and never imports rich, so the torch-free planner
and search stay plain::

    with progress.phase("profile", total=15, unit="layers measured") as phase:
        for layer in layers:
            ...
            phase.advance(work=1.0)   # a reused layer advances by less work: the ETA knows

Who shows it is decided once, by the caller (``progress_for``): on a terminal a live rich bar with
the time left; elsewhere (a pipe, a log file, CI) a plain line at most every ``Lines.every``
seconds while a phase runs, and one when it ends, e.g. ``profile: 7/15 layers measured, ~40 s
left``, which is how `autopipe convert | tee` stopped printing nothing for five minutes (issue 41).
A phase over before ``every`` seconds says nothing (nobody waited for it, and a refusal stays one
line); ``Quiet`` shows nothing at all (``progress=False``).

The time left is the work still to do at the pace of the work done: each step may weigh its share
(a layer timed again weighs more than one reused), and a phase whose amount is not known ahead
(``total=None``) shows its count and elapsed time only.

Example:
    >>> import io
    >>> out = io.StringIO()
    >>> lines = Lines(out, every=5.0, clock=iter([0.0, 10.0, 10.0, 10.0, 40.0]).__next__)
    >>> with lines.phase("profile", total=4, unit="layers measured") as phase:
    ...     phase.advance()
    ...     phase.advance(3)
    >>> print(out.getvalue(), end="")
    profile: 1/4 layers measured, ~30 s left
    profile: 4/4 layers measured in 40 s
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

__all__ = ["Lines", "Live", "Phase", "Progress", "Quiet", "format_seconds", "progress_for"]


def format_seconds(seconds: float) -> str:
    """``45 s``, ``3m12s``, ``2h05m``: a time left or taken, as a person reads it.

    >>> format_seconds(7.4), format_seconds(192.4), format_seconds(7500)
    ('7 s', '3m12s', '2h05m')
    """
    s = max(0, int(round(seconds)))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s} s"


class Phase:
    """One phase of a pass: how many of ``total`` items are done, and how much of the work.

    ``work`` is what the time left is reckoned in (each item 1 unless told), ``total_work`` how much
    there is (``total`` unless told); both grow where a pass finds more to do (``extend``).
    """

    def __init__(self, show: Progress, name: str, total: int | None, unit: str, total_work: float | None,
                 clock: Callable[[], float]) -> None:  # fmt: skip
        self.show, self.name, self.total, self.unit, self.clock = show, name, total, unit, clock
        self.total_work = total_work if total_work is not None else (float(total) if total is not None else None)
        self.done, self.work, self.what, self.note = 0, 0.0, "", ""
        self.started = clock()

    def advance(self, items: int = 1, *, work: float | None = None, what: str = "") -> None:
        """``items`` more done, weighing ``work`` (default: one per item); ``what``: the one now running."""
        self.done += items
        self.work += float(items) if work is None else float(work)
        self.what = what or self.what
        self.show._changed(self)

    def set(self, done: int, *, what: str = "") -> None:
        """``done`` items done in all (each weighing one): for a count read from elsewhere (a rank's step)."""
        if done != self.done:
            self.work += done - self.done
            self.done = done
            self.what = what or self.what
            self.show._changed(self)

    def extend(self, total: int, *, total_work: float | None = None) -> None:
        """There are ``total`` items after all (more runs than planned, say)."""
        self.total = total
        self.total_work = total_work if total_work is not None else float(total)

    def finish(self, note: str = "") -> None:
        """Say why the phase ends before its total (a search that prunes the rest): ``note``."""
        self.note = note

    @property
    def elapsed(self) -> float:
        return self.clock() - self.started

    def left(self) -> float | None:
        """Seconds still to go at the pace so far; None before any work is done or with no total."""
        if self.total_work is None or self.work <= 0:
            return None
        return max(0.0, self.total_work - self.work) * self.elapsed / self.work

    def count(self) -> str:
        """``7/15 layers measured`` (``7 layers measured`` with no total; ``running`` with neither)."""
        if self.total is None and not self.unit:
            return "running"
        of = f"/{self.total}" if self.total is not None else ""
        return f"{self.done}{of} {self.unit}".rstrip()


class Progress:
    """What a pass reports its phases to; this base shows nothing (``Quiet``)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock

    @contextmanager
    def phase(self, name: str, *, total: int | None = None, unit: str = "", total_work: float | None = None
              ) -> Iterator[Phase]:  # fmt: skip
        """A phase of ``total`` items (``unit`` names them: ``layers measured``), shown while it runs."""
        phase = Phase(self, name, total, unit, total_work, self.clock)
        self._started(phase)
        try:
            yield phase
        finally:
            self._ended(phase)

    # what a display does; the base does nothing
    def _started(self, phase: Phase) -> None:
        pass

    def _changed(self, phase: Phase) -> None:
        pass

    def _ended(self, phase: Phase) -> None:
        pass


class Quiet(Progress):
    """Shows nothing: the library asked to keep quiet (``progress=False``)."""


class Lines(Progress):
    """A plain line per phase at most every ``every`` seconds while it runs, and one when it ends
    (none for a phase over sooner; a phase of no count, which never advances, says it started); for
    output that is not a terminal (a pipe, a log file, CI)."""

    def __init__(self, stream: IO[str] | None = None, *, every: float = 10.0,
                 clock: Callable[[], float] = time.perf_counter) -> None:  # fmt: skip
        super().__init__(clock)
        self.stream = stream
        self.every = every
        self._last: dict[int, float] = {}
        self._spoke: set[int] = set()  # phases that said something: they say when they end

    def _say(self, text: str) -> None:
        stream = self.stream if self.stream is not None else sys.stderr
        print(text, file=stream, flush=True)

    def _started(self, phase: Phase) -> None:
        self._last[id(phase)] = phase.started
        if phase.total is None and not phase.unit:  # nothing will advance: say now what is running
            self._spoke.add(id(phase))
            self._say(f"{phase.name}: {phase.count()}")

    def _changed(self, phase: Phase) -> None:
        now = self.clock()
        if now - self._last.get(id(phase), 0.0) < self.every or (phase.total is not None and phase.done >= phase.total):
            return  # not yet (or the end, which _ended says)
        self._last[id(phase)] = now
        self._spoke.add(id(phase))
        left = phase.left()
        self._say(f"{phase.name}: {phase.count()}" + (f", ~{format_seconds(left)} left" if left is not None else
                                                       f", {format_seconds(phase.elapsed)} so far"))

    def _ended(self, phase: Phase) -> None:
        self._last.pop(id(phase), None)
        elapsed = phase.elapsed
        if id(phase) not in self._spoke and elapsed < self.every:
            return  # over before anyone waited: nothing to say
        self._spoke.discard(id(phase))
        note = f" ({phase.note})" if phase.note else ""
        self._say(f"{phase.name}: {phase.count()}{note} in {format_seconds(elapsed)}")


class Live(Progress):
    """A live rich bar per phase on a terminal (redrawn in place, gone when the phase ends), with
    the item running and the time left."""

    def __init__(self, console: Any = None, *, clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__(clock)
        self.console = console
        self._bars: dict[int, tuple[Any, Any]] = {}

    def _started(self, phase: Phase) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn

        bar = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[left]}"), console=self.console or Console(stderr=True, emoji=False), transient=True)
        task = bar.add_task(phase.name, total=phase.total, left="")
        bar.start()
        self._bars[id(phase)] = (bar, task)

    def _changed(self, phase: Phase) -> None:
        bar, task = self._bars[id(phase)]
        left = phase.left()
        what = f" {phase.what}" if phase.what else ""
        bar.update(task, completed=phase.done, total=phase.total, description=f"{phase.name}{what}",
                   left=f"~{format_seconds(left)} left" if left is not None else "")

    def _ended(self, phase: Phase) -> None:
        bar, _task = self._bars.pop(id(phase))
        bar.stop()


def progress_for(shown: bool | Progress, stream: IO[str] | None = None) -> Progress:
    """The display for ``shown``: a Progress given is used as it is; False is ``Quiet``; True is a
    ``Live`` bar when ``stream`` (default stderr, where progress goes) is a terminal, else ``Lines``."""
    if isinstance(shown, Progress):
        return shown
    if not shown:
        return Quiet()
    out = stream if stream is not None else sys.stderr
    return Live() if getattr(out, "isatty", lambda: False)() else Lines(stream)
