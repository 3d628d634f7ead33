"""The README's examples run as written, and it stays a landing page."""

import re
from pathlib import Path

import kvtier

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no python example"
    for block in blocks:
        exec(compile(block, str(README), "exec"), {})


def test_readme_yaml_stacks_load():
    blocks = re.findall(r"```yaml\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no stack"
    for block in blocks:
        kvtier.load_config(block)


def test_readme_starts_with_the_two_commands_ci_runs():
    text = README.read_text()
    commands = re.findall(r"^python3 -m venv .*$", text, flags=re.M)
    assert len(commands) >= 2
    ci = (README.parent / ".ci" / "run").read_text()
    assert commands[1].replace("pip install", "pip install -q") in ci


def test_readme_is_a_landing_page():
    # issue #24: reference, research and results live in docs/, the README links to them
    assert len(README.read_text().splitlines()) <= 250


def test_readme_links_resolve():
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README.read_text()):
        assert (README.parent / target).exists(), target


def test_readme_gives_the_suites_length_and_its_quick_loop():
    import tomllib

    text = " ".join(README.read_text().split())
    assert re.search(r"The whole suite takes about \d+ minutes", text)
    loop = re.search(r'pytest -n auto -m "(not \w+)"', text).group(1)
    markers = tomllib.loads((README.parent / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"][
        "markers"
    ]
    assert any(marker.startswith(loop.split()[1] + ":") for marker in markers)
