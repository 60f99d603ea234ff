"""The README's first code example runs as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_usage_example_runs(capsys):
    text = README.read_text()
    section = text.split("## Use it in your code", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "bytes: estimated peak with mirroring" in out
