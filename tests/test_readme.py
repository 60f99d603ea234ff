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
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "bytes: estimated peak with mirroring" in out


def test_the_exit_statuses_of_train_are_the_ones_the_code_returns():
    text = " ".join(README.read_text().split())
    assert (
        f"{exit_status(signal.SIGINT)} for Ctrl-C (SIGINT), "
        f"{exit_status(signal.SIGTERM)} for SIGTERM"
    ) in text
    assert "an explicit `--lr` replaces it" in text  # --resume keeps the checkpoint's lr
