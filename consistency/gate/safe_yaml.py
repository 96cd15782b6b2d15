# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Config files read without surprises: a size limit, no YAML aliases, no duplicate keys.

PyYAML's ``safe_load`` expands anchors and aliases while it builds the document, before any setting is
type-checked, so a few hundred bytes of nested aliases ("billion laughs") expand to gigabytes; and a key
given twice silently keeps the last value. A settings file needs neither feature, so [`load_yaml`] refuses
both, and [`read_limited`] refuses a file larger than [`MAX_CONFIG_BYTES`] before parsing it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_CONFIG_BYTES", "SafeYamlError", "load_yaml", "read_limited"]

#: Largest config file read (1 MiB); a settings file is a few hundred bytes.
MAX_CONFIG_BYTES = 1 << 20


class SafeYamlError(ValueError):
    """A config file that is too large, uses aliases, or repeats a key. The message names the fix."""


def read_limited(path: str, limit: int = MAX_CONFIG_BYTES) -> bytes:
    """The bytes of `path`, refusing (without reading it all) a file of more than `limit` bytes."""
    with open(path, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise SafeYamlError(
            f"config file {path!r} is larger than {limit} bytes; a settings file is small — is this the right file?"
        )
    return data


def load_yaml(text: str | bytes, source: str) -> Any:
    """Parse one YAML document with the safe loader, refusing aliases and duplicate mapping keys."""
    import yaml

    class _Loader(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise SafeYamlError(
                    f"config file {source!r} line {event.start_mark.line + 1}: YAML aliases (*{event.anchor}) are not "
                    f"accepted in settings files; write the value out."
                )
            return super().compose_node(parent, index)

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if isinstance(key, (list, dict)):
                    continue  # unhashable: the mapping constructor reports it
                if key in seen:
                    raise SafeYamlError(
                        f"config file {source!r} line {key_node.start_mark.line + 1}: key {key!r} is given twice; "
                        f"keep one (YAML would silently use the last)."
                    )
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return yaml.load(text, Loader=_Loader)
