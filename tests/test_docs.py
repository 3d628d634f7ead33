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


def _tables():
    spec = importlib.util.spec_from_file_location("gen_tables", DOCS / "gen_tables.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return gen


@pytest.mark.parametrize(
    "name", ["plan-synthetic", pytest.param("plan-conversation", marks=pytest.mark.slow)]
)
def test_plan_tables_are_what_kvtier_plan_prints(name):
    """kvtier plan is deterministic: its first row, recomputed, is the committed one."""
    gen = _tables()
    first = gen.PLAN_TABLES[name][1][0]
    (row,) = gen.plan_rows(gen.plan_record(name, [first], jobs=1))
    assert row in gen.committed(name, "docs/policies.md").splitlines(), (
        f"docs/policies.md's {name} table is stale: run python docs/gen_tables.py {name}"
    )


@pytest.mark.slow
def test_replay_tables_are_what_a_deterministic_replay_prints():
    """The README's exact figures are those of `kvtier replay --deterministic`, to the block."""
    gen = _tables()
    body = gen.replay_exact(gen.replay_record(deterministic=True))
    for path in gen.FILES["replay-exact"]:
        assert gen.committed("replay-exact", path) == body, (
            f"{path}: the replay table is stale: run python docs/gen_tables.py replay-exact replay-runs"
        )


def test_configuration_page_names_every_kind_and_policy():
    from kvtier.config import TIER_KINDS
    from kvtier.policies import POLICIES

    text = (DOCS / "configuration.md").read_text()
    kinds = re.search(r"`kvtier\.config\.TIER_KINDS` \((.*?)\), or", text, re.S).group(1)
    assert set(re.findall(r"`(\w+)`", kinds)) == set(TIER_KINDS.names())
    policies = re.search(r"the\s+policies are (.*?), see", text, re.S).group(1)
    assert re.findall(r"`(\w+)`", policies) == list(POLICIES.names())


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
