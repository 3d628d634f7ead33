"""Every command's one output rule: text for people on stdout, and with ``--json`` exactly one
JSON line there and nothing else (``kvtier stats``, ``check`` and ``generate`` have their own tests)."""

import json

import pytest

from kvtier.cli.main import main

CHAINS = [(1, 2, 3), (1, 2, 4), (1, 2, 3)]


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(
                {"timestamp": i, "input_length": 512 * len(c), "output_length": 1, "hash_ids": list(c)}
            )
            for i, c in enumerate(CHAINS * 10)
        )
    )
    return str(path)


COMMANDS = {
    name: argv.split()
    for name, argv in {
        "model": "model Qwen3-8B",
        "plan": "plan {trace} --capacities 3 10 --policies lru --jobs 1 --no-progress",
        "plan --model": "plan {trace} --capacities 3 --policies lru --jobs 1 --model Qwen3-8B",
        "replay": "replay {trace} --no-progress --no-baseline --block-bytes 4096",
        "replay --engines": "replay {trace} --engines 1 --no-baseline --block-bytes 4096",
        "bench manager": "bench manager --keys 500 --capacity 200 --runs 1",
        "bench transfer": "bench transfer --device cpu --max-batch 1 --layers 1 --runs 1",
        "bench disk": "bench disk --backend files --gib 0.004 --rounds 1 --open-blocks 0 --threads 2 "
        "--dir {tmp} --no-drop-caches",
        "bench remote": "bench remote --mib 1 --rounds 1",
        "bench cascade": "bench cascade {trace}",
        "bench codec": "bench codec --codecs int8 --block-bytes 4096 --mib 1 --rounds 1",
        "soak": "soak --minutes 0.005 --dir {tmp}",
    }.items()
}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_text_by_default_and_one_json_line_with_json(name, trace, tmp_path, capsys):
    argv = [arg.format(trace=trace, tmp=tmp_path) for arg in COMMANDS[name]]
    assert main(argv) == 0
    text = capsys.readouterr().out.splitlines()
    assert text and not any(_is_json_object(line) for line in text), name
    assert main([*argv, "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and _is_json_object(lines[0]), name


def test_a_benchmark_script_prints_the_table_then_the_json_line(capsys):
    # benchmarks/bench_*.py run a command with table_and_json: the table, then one JSON line
    argv = COMMANDS["bench transfer"]
    assert main(argv, table_and_json=True) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) > 1 and not any(_is_json_object(line) for line in lines[:-1])
    assert json.loads(lines[-1])["bench"] == "transfer"
