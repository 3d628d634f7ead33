"""Read kvtier YAML: a strict loader (no duplicate keys, no alias bombs) and file reading with fixes."""

from __future__ import annotations

import os

import yaml

from kvtier.errors import ConfigError, shown_value

__all__ = ["MAX_CONFIG_BYTES", "MAX_YAML_NODES", "load_yaml", "read_file"]

#: the most characters of a configuration file read (a real one is a few KiB)
MAX_CONFIG_BYTES = 1 << 20
#: the most nodes a kvtier YAML document may hold once its aliases are expanded. A real
#: config has a few dozen; a few hundred bytes of nested aliases expand to billions.
MAX_YAML_NODES = 10_000


class _ExpansionError(yaml.composer.ComposerError):
    """A document too large once its aliases are expanded, or recursive through them."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys and documents too large once expanded.

    PyYAML keeps the last of two equal keys without a word; a tier written twice would lose
    its first half as silently as a misspelt key would.

    Aliases stay allowed (``<<: *disk`` overrides are worth having), but the composed
    document is measured with every alias expanded before anything is built from it: the
    node graph shares an aliased node, while what is built from it (and any repr of it in
    an error message) is as large as the expansion. Refusing aliases outright was the
    alternative; counting keeps merges and bounds the same attack.
    """

    def get_single_data(self):
        node = self.get_single_node()
        if node is None:
            return None
        _check_expanded_size(node)
        return self.construct_document(node)

    def construct_mapping(self, node, deep=False):
        seen: set[object] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<:` overrides are what a merge is for
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:
                continue  # unhashable: the base class reports it with its mark
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {shown_value(key)}",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _check_expanded_size(root: yaml.Node) -> None:
    """Raise a composer error at the node whose expansion passes :data:`MAX_YAML_NODES`
    (the deepest such node: where the aliases multiply), or at an alias of its own ancestor."""
    sizes: dict[int, int] = {}
    visiting: set[int] = set()

    def children(node: yaml.Node) -> list[yaml.Node]:
        if isinstance(node, yaml.SequenceNode):
            return list(node.value)
        if isinstance(node, yaml.MappingNode):
            return [part for pair in node.value for part in pair]
        return []

    def size(node: yaml.Node) -> int:  # memoized: each distinct node is walked once
        known = sizes.get(id(node))
        if known is not None:
            return known
        if id(node) in visiting:
            raise _ExpansionError(
                None,
                None,
                "found an alias of a node that contains it (a recursive document)",
                node.start_mark,
            )
        visiting.add(id(node))
        total = 1 + sum(size(child) for child in children(node))
        visiting.discard(id(node))
        sizes[id(node)] = total
        return total

    if size(root) <= MAX_YAML_NODES:
        return
    node = root
    while True:
        larger = [child for child in children(node) if sizes[id(child)] > MAX_YAML_NODES]
        if not larger:
            break
        node = larger[0]
    raise _ExpansionError(
        None,
        None,
        f"this node expands to {sizes[id(node)]:,} nodes through its aliases, more than the "
        f"{MAX_YAML_NODES:,} a kvtier configuration may hold (nested aliases)",
        node.start_mark,
    )


def load_yaml(text: str, where: str) -> object:
    try:
        # a SafeLoader subclass, so YAML tags cannot build arbitrary Python objects
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as error:
        raise _yaml_error(error, text, where) from None
    except RecursionError:  # PyYAML composes and builds recursively
        raise ConfigError(
            where, text[:80], "YAML nested at most a few hundred levels deep", "flatten the document"
        ) from None
    except ValueError as error:  # e.g. an int of more than 4,300 digits
        raise ConfigError(
            where, text[:80], f"valid YAML values ({error})", "check the numbers in the document"
        ) from None


def _at(mark: yaml.Mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _yaml_error(error: yaml.YAMLError, text: str, where: str) -> ConfigError:
    """A ConfigError that points at the line and column PyYAML blamed."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    context, context_mark = getattr(error, "context", None), getattr(error, "context_mark", None)
    if context and context_mark is not None:
        # an unclosed bracket is reported at the end of input; where it opened is the clue
        problem = f"{problem}, {context} at {_at(context_mark)}"
    if mark is None:
        return ConfigError(where, text[:80], f"valid YAML ({problem})")
    lines = text.splitlines()
    line = lines[mark.line].strip() if mark.line < len(lines) else ""
    fix = (
        f"write the values at {_at(mark)} out instead of through nested aliases"
        if isinstance(error, _ExpansionError)
        else f"check the indentation, quoting and brackets at {_at(mark)}"
    )
    return ConfigError(f"{where} {_at(mark)}", line or "<end of input>", f"valid YAML ({problem})", fix)


def read_file(path: str | os.PathLike, field: str) -> str:
    """The text of the YAML file ``path``, at most :data:`MAX_CONFIG_BYTES` of it (a device
    such as /dev/zero is refused, not read without end); a ConfigError naming ``field``."""
    shown = os.fsdecode(path)
    try:
        with open(path, encoding="utf-8") as stream:
            text = stream.read(MAX_CONFIG_BYTES + 1)
        if len(text) > MAX_CONFIG_BYTES:
            raise ConfigError(
                field,
                shown,
                f"a YAML file of at most {MAX_CONFIG_BYTES} characters",
                "name the configuration file",
            )
        return text
    except FileNotFoundError:
        raise ConfigError(
            field,
            shown,
            "the path of an existing kvtier YAML file",
            f"check the path (it resolves to {os.path.abspath(shown)}), or pass the YAML text itself",
        ) from None
    except IsADirectoryError:
        raise ConfigError(field, shown, "a YAML file, not a directory", "name the file inside it") from None
    except UnicodeDecodeError as error:
        raise ConfigError(
            field, shown, "a UTF-8 text file", f"re-save it as UTF-8 ({error.reason})"
        ) from None
    except OSError as error:
        raise ConfigError(field, shown, "a readable YAML file", f"fix the file: {error.strerror}") from None
