"""The README's Python examples run as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no python example"
    for block in blocks:
        exec(compile(block, str(README), "exec"), {})


def test_readme_starts_with_the_two_commands_ci_runs():
    text = README.read_text()
    commands = re.findall(r"^python3 -m venv .*$", text, flags=re.M)
    assert len(commands) >= 2
    ci = (README.parent / ".ci" / "run").read_text()
    assert commands[1].replace("pip install", "pip install -q") in ci
