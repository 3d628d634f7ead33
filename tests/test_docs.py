"""The docs' examples run as written, and the generated pages match the code.

Every ```python block in docs/ runs (each in a fresh namespace). A block that needs what CI
lacks says so on the line just before its fence, and is skipped with that reason::

    <!-- docs-test: requires=gpu -->     (skipped unless torch sees CUDA)
    <!-- docs-test: requires=vllm -->    (skipped unless vllm imports)
    <!-- docs-test: skip REASON -->      (never run here; the reason is shown)

Every ```yaml block that is a whole configuration (it has a top-level ``tiers:``) must
load with ``kvtier.load_config``.
"""

import importlib.util
import re
from pathlib import Path

import pytest
import yaml

import kvtier

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
_FENCE = re.compile(
    r"^(?:<!-- docs-test: (?P<mark>[^>]*?) -->\n)?```(?P<lang>\w+)\n(?P<body>.*?)^```", re.M | re.S
)


def _blocks(lang: str) -> list:
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        for m in _FENCE.finditer(text):
            if m.group("lang") == lang:
                line = text.count("\n", 0, m.start("body")) + 1
                found.append(
                    pytest.param(
                        page, line, m.group("mark"), m.group("body"), id=f"{page.relative_to(DOCS)}:{line}"
                    )
                )
    return found


def _skip_reason(mark: str | None) -> str | None:
    if mark is None:
        return None
    if mark == "requires=gpu":
        import torch

        return None if torch.cuda.is_available() else "needs a CUDA GPU"
    if mark == "requires=vllm":
        return None if importlib.util.find_spec("vllm") else "needs vllm"
    if mark.startswith("skip"):
        return mark[4:].strip() or "marked skip"
    raise AssertionError(f"unknown docs-test marker {mark!r}: requires=gpu, requires=vllm or skip REASON")


@pytest.mark.parametrize(("page", "line", "mark", "body"), _blocks("python"))
def test_docs_python_block_runs(page, line, mark, body):
    reason = _skip_reason(mark)
    if reason:
        pytest.skip(reason)
    code = compile("\n" * (line - 1) + body, str(page), "exec")  # tracebacks name the page's line
    exec(code, {"__name__": "__docs__"})


def test_docs_have_python_examples():
    assert len(_blocks("python")) >= 3


@pytest.mark.parametrize(("page", "line", "mark", "body"), _blocks("yaml"))
def test_docs_yaml_configuration_loads(page, line, mark, body):
    if not re.search(r"^tiers:", body, re.M):
        pytest.skip("a fragment, not a whole configuration")
    kvtier.load_config(body)


def test_configuration_reference_is_current():
    spec = importlib.util.spec_from_file_location("gen_config", DOCS / "gen_config.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (DOCS / "reference" / "configuration.md").read_text() == gen.render(), (
        "docs/reference/configuration.md is stale: run python docs/gen_config.py"
    )


def test_every_page_is_in_the_nav():
    def pages(node):
        if isinstance(node, str):
            yield node
        elif isinstance(node, list):
            for item in node:
                yield from pages(item)
        elif isinstance(node, dict):
            for value in node.values():
                yield from pages(value)

    nav = set(pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]))
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert on_disk - nav == set(), "pages missing from mkdocs.yml's nav"
    assert nav - on_disk == set(), "nav entries without a page"
