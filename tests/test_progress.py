"""LoggedProgress: one plain line per tenth of a task where stderr is not a terminal."""

import io

from rich.console import Console

from exactspec.progress import LoggedProgress, duration


def run(console: Console, advances, total=20, **kwargs) -> list[str]:
    with LoggedProgress(console=console, transient=True, **kwargs) as progress:
        task = progress.add_task("audit engine", total=total)
        for n in advances:
            progress.advance(task, n)
    return [line for line in console.file.getvalue().splitlines() if "elapsed" in line]


def test_off_a_terminal_each_tenth_prints_one_line():
    lines = run(Console(file=io.StringIO(), force_terminal=False), [1] * 20)
    assert [line.split(":")[1].split("%")[0].strip() for line in lines] == [
        str(p) for p in range(10, 101, 10)]
    assert lines[2].startswith("audit engine: 30% (6 of 20), ") and "s left" in lines[2]
    assert "left" not in lines[-1]  # finished: no estimate


def test_a_large_step_prints_once_at_the_share_reached():
    # 35 %, then 37.5 % (no new tenth: no line), then 100 %
    lines = run(Console(file=io.StringIO(), force_terminal=False), [7, 0.5, 12.5])
    assert [line.split(" (")[0] for line in lines] == ["audit engine: 35%", "audit engine: 100%"]


def test_on_a_terminal_or_disabled_no_lines():
    assert run(Console(file=io.StringIO(), force_terminal=True), [1] * 20) == []
    assert run(Console(file=io.StringIO(), force_terminal=False), [1] * 20, disable=True) == []


def test_duration():
    assert [duration(s) for s in (0.4, 59, 60, 754, 3599, 3600, 3900)] == [
        "0 s", "59 s", "1 min", "13 min", "60 min", "1 h 00 min", "1 h 05 min"]
