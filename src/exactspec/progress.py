"""Progress bars for long work (bench, audit).

rich draws its bar only on a terminal: in a log file or CI it prints nothing until the work
ends, which for an audit is an hour of silence. :class:`LoggedProgress` is rich's bar on
stderr that, where stderr is not a terminal, also prints one plain line each time a task
passes a tenth of its total.
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import Progress, TaskID


class LoggedProgress(Progress):
    """:class:`rich.progress.Progress` on stderr (stdout is for reports). Off a terminal, each
    tenth of a task prints e.g. ``exactspec prompt-lookup k=4 constant: 30% (3000 of 10000),
    12 min elapsed, about 28 min left`` (at the mean rate so far). ``disable=True`` prints
    nothing at all.
    """

    def __init__(self, *columns, console: Console | None = None, steps: int = 10,
                 **kwargs) -> None:
        super().__init__(*columns, console=console or Console(stderr=True), **kwargs)
        self._steps = steps
        self._logged: dict[TaskID, int] = {}

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        if self.disable or self.console.is_terminal:
            return
        task = next(t for t in self.tasks if t.id == task_id)
        if not task.total:
            return
        step = int(task.completed * self._steps // task.total)
        if step <= self._logged.get(task_id, 0):
            return
        self._logged[task_id] = step
        elapsed = task.elapsed or 0.0
        left = elapsed * (task.total - task.completed) / task.completed
        self.console.print(
            f"{task.description}: {task.percentage:.0f}% ({task.completed:g} of "
            f"{task.total:g}), {duration(elapsed)} elapsed"
            + (f", about {duration(left)} left" if left > 0 else ""),
            highlight=False, soft_wrap=True)


def duration(seconds: float) -> str:
    """``42 s``, ``12 min`` or ``1 h 05 min``."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    hours, minutes = divmod(round(seconds / 60), 60)
    return f"{hours} h {minutes:02d} min"
