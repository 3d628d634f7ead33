"""How kvtier is installed, as the docs and messages say it: every ``pip install`` works as written.

kvtier is not on a package index: it installs from its checkout or from a wheel built there
(``scripts/check-wheel.sh``, which CI runs, installs one outside the checkout with an extra).
So no hint may ask an index for ``kvtier``; a hint for an optional feature names the extra's
own packages exactly as ``pyproject.toml`` pins them (what :func:`kvtier.extras.install_hint`
prints), and one that installs the checkout or a wheel names extras that exist. Nothing the
repository runs or documents needs a file beside the checkout.
"""

import re
import shlex
from pathlib import Path

import pytest

from kvtier.extras import extra_requirements, install_hint

ROOT = Path(__file__).resolve().parent.parent
#: the extras a user may need beside an engine (the others are for working on kvtier)
USER_EXTRAS = ("plot", "prometheus", "valkey", "secure", "transformers")
ALL_EXTRAS = (*USER_EXTRAS, "test", "docs")
# the arguments of one hint: up to the end of the command (a shell operator, a closing
# backtick or parenthesis, the end of a Python string or of the line)
_HINT = re.compile(r"""\bpip install ((?:'[^'\n]*'|[^`"()\n;&|#])*)""")
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def _files():
    """The repository's own text files (never a virtual environment or a build's output)."""
    yield from (ROOT / name for name in ("README.md", "CHANGELOG.md", "pyproject.toml", "mkdocs.yml"))
    yield ROOT / ".ci" / "run"
    for folder in ("docs", "src", "tests", "examples", "scripts", "benchmarks"):
        for path in (ROOT / folder).rglob("*"):
            if (
                path.suffix in (".md", ".py", ".sh", ".yaml", ".toml", ".json")
                and "__pycache__" not in path.parts
            ):
                yield path


def _hints():
    found = []
    for path in sorted(set(_files())):
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
            for match in _HINT.finditer(line):
                where = f"{path.relative_to(ROOT)}:{number}"
                found.append(pytest.param(match.group(1).strip(), id=where))
    return found


def _requirements(extra):
    found = extra_requirements(extra)
    assert found, f"kvtier's metadata has no {extra!r} extra: reinstall kvtier (pip install -e '.[test]')"
    return found


def _problem(args: str) -> str | None:
    """What keeps ``pip install ARGS`` from working as written, or None."""
    args = args.removesuffix("\\").strip()  # a command continued on the next line
    try:
        tokens = shlex.split(args)
    except ValueError:  # a hint cut by the end of its line: the start is all there is to check
        tokens = shlex.split(args + "'")
    for token in tokens:
        if token.startswith("-") or any(c in token for c in "${}\\"):
            continue  # an option, a shell variable, a template's field, a line continuation
        if token.startswith((".", "/", "~")) or ".whl" in token:  # the checkout, or a wheel
            for extra in ",".join(re.findall(r"\[([^\]]*)\]", token)).split(","):
                if extra and extra not in ALL_EXTRAS:
                    return f"{token}: kvtier has no extra {extra!r}"
            continue
        name = _NAME.match(token)
        if name is None:
            return f"{token!r} is not a requirement"
        if name.group(0).lower() == "kvtier":
            return (
                f"{args!r}: kvtier is not on a package index; install the checkout "
                "(pip install /path/to/kvtier) or a wheel built from it (docs/getting-started.md)"
            )
        for extra in USER_EXTRAS:
            pins = _requirements(extra)
            if name.group(0).lower() in {_NAME.match(pin).group(0).lower() for pin in pins}:
                if any(pin not in tokens for pin in pins):
                    return f"{args!r}: for kvtier's {extra} extra write {install_hint(extra)}"
    return None


@pytest.mark.parametrize("args", _hints())
def test_each_pip_install_hint_works_as_written(args):
    assert _problem(args) is None, _problem(args)


@pytest.mark.parametrize(
    "args",
    [
        "kvtier",
        "'kvtier[plot]'",
        "matplotlib",
        "'valkey>=6.1'",
        "-e '.[nope]'",
        "'dist/kvtier-0.1.0-py3-none-any.whl[x]'",
    ],
)
def test_a_hint_that_would_not_work_is_found(args):
    assert _problem(args) is not None


def test_there_are_hints_to_check():
    assert len(_hints()) >= 10


@pytest.mark.parametrize("extra", USER_EXTRAS)
def test_the_message_hint_names_the_extras_pins(extra):
    hint = install_hint(extra)
    assert hint.startswith("pip install ") and hint.endswith(f"(kvtier's {extra} extra)")
    assert shlex.split(hint.removesuffix(f" (kvtier's {extra} extra)"))[2:] == _requirements(extra)


def test_kvtier_version_is_the_packages():
    import importlib.metadata
    import subprocess
    import sys

    import kvtier

    assert importlib.metadata.version("kvtier") == kvtier.__version__
    shown = subprocess.run(
        [str(Path(sys.executable).parent / "kvtier"), "--version"], capture_output=True, text=True, check=True
    )
    assert shown.stdout.strip() == f"kvtier {kvtier.__version__}"
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## [{kvtier.__version__}]" in changelog, "CHANGELOG.md has no section for this version"
    for path in sorted(_files()):
        for named in re.findall(
            r"kvtier-(\d+\.\d+\.\d+\w*)-py3-none-any\.whl", path.read_text(errors="replace")
        ):
            assert named == kvtier.__version__, f"{path.relative_to(ROOT)} names the wheel of {named}"


def test_nothing_needs_a_file_beside_the_checkout():
    # the vLLM environment, vLLM's replay driver and the traces once lived in ../shared
    beside = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted(set(_files()))
        if path != Path(__file__)
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1)
        if "../shared" in line
    ]
    assert beside == [], beside
