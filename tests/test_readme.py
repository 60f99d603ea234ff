"""The README's first code example runs as written."""

import pathlib
import re
import signal

from mirrorgrad.train.stop import exit_status

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_usage_example_runs(capsys):
    text = README.read_text()
    section = text.split("## Use it in your code", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    out = capsys.readouterr().out
    assert "bytes: estimated peak with mirroring" in out
    # The first example is one where the plan matters: mirroring lowers the peak.
    plan = namespace["step"]._mirrorgrad_plans[0]
    assert plan.peak_after < 0.7 * plan.peak_before
    # ... and the output the README shows is the one the example prints.
    shown = text.split("## Use it in your code", 1)[1]
    shown = re.search(r"```text\n(.*?)```", shown, re.S).group(1)
    assert shown == out


def test_the_exit_statuses_of_train_are_the_ones_the_code_returns():
    text = " ".join(README.read_text().split())
    assert (
        f"{exit_status(signal.SIGINT)} for Ctrl-C (SIGINT), "
        f"{exit_status(signal.SIGTERM)} for SIGTERM"
    ) in text
    assert "an explicit `--lr` replaces it" in text  # --resume keeps the checkpoint's lr
