"""``load_config``: the one entry point from a path, YAML text, a dict or vLLM's extra config."""

from __future__ import annotations

import os
from collections.abc import Mapping

from kvtier.config.parse import parse_document
from kvtier.config.schema import KvtierConfig
from kvtier.config.source import load_yaml, read_file
from kvtier.errors import ConfigError

__all__ = ["CONFIG_ENV", "env_config_path", "load_config"]

#: the environment variable naming a kvtier YAML file, for wherever a configuration path is
#: taken and none was given (docs/configuration.md, "Where kvtier finds its configuration")
CONFIG_ENV = "KVTIER_CONFIG"


def env_config_path() -> str | None:
    """The path ``KVTIER_CONFIG`` names, or None when it is unset or empty.

    The fallback of each place that takes a configuration path when none was given there:
    ``kvtier config check``, ``kvtier model --config``, ``kvtier check --config``, vLLM's
    ``kvtier_config`` and SGLang's ``config``. A path or inline keys given there win.
    ``kvtier replay`` never reads it: a replay fills the stack's stores with its own blocks,
    and a store opened for another layout is wiped, so a production store must be named.
    """
    return os.environ.get(CONFIG_ENV) or None


def _looks_like_path(text: str) -> bool:
    """Whether a str that names no existing file was meant as a path rather than YAML text.

    One line with no colon cannot be a useful YAML document; a one-line ``*.yaml`` with a
    colon not followed by a space is a path such as ``C:/kvtier.yaml`` (a YAML key needs
    ``: ``), while ``kvtier_config: tiers.yaml`` stays YAML.
    """
    if "\n" in text:
        return False
    if ":" not in text:
        return True
    return text.rstrip().endswith((".yaml", ".yml")) and ": " not in text


def load_config(source: object) -> KvtierConfig:
    """Parse ``source`` into a KvtierConfig, raising ConfigError for anything wrong with it.

    ``source`` is one of:

    * a KvtierConfig, returned as is;
    * a dict: the kvtier schema, or vLLM's ``kv_connector_extra_config`` (whose keys
      spec_name, spec_module_path and offload_prompt_only are skipped, ``block_size`` is an
      alias of block_size_tokens, and ``kvtier_config`` names a YAML file to load instead of
      inline keys);
    * a path (str or os.PathLike) to a kvtier YAML file;
    * YAML text: a str holding a newline or a colon that names no existing file.

    A YAML file or text holds kvtier keys only (tiers, cascade, block_size_tokens).
    """
    if isinstance(source, KvtierConfig):
        return source
    if isinstance(source, Mapping):
        return parse_document(source, "config", from_yaml=False)
    if isinstance(source, os.PathLike):
        shown = os.fsdecode(source)
        text = read_file(source, "config")
        return parse_document(load_yaml(text, shown), shown, from_yaml=True)
    if isinstance(source, str):
        if not source.strip():
            raise ConfigError(
                "config",
                source,
                "a path to a kvtier YAML file, YAML text, a dict or a KvtierConfig",
                "pass the path of a YAML file such as examples/cpu-only.yaml",
            )
        if os.path.isfile(source) or _looks_like_path(source):
            text = read_file(source, "config")
            return parse_document(load_yaml(text, source), source, from_yaml=True)
        return parse_document(load_yaml(source, "YAML text"), "YAML text", from_yaml=True)
    raise ConfigError(
        "config",
        source,
        "a path to a kvtier YAML file, YAML text, a dict or a KvtierConfig",
        "pass one of those",
    )
