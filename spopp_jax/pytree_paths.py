"""One spelling of a pytree key path (used by the learner, checkpoints and partitioning).

``path_parts(path)``: each entry as a string: a dict key (``DictKey.key``,
``FlattenedIndexKey.key``), an attribute (``GetAttrKey.name``: dataclass / NamedTuple
fields) or a sequence index (``SequenceKey.idx``). Orbax metadata and live pytrees spell
the same path with different entry types; the strings agree. ``strip_value=True`` drops a
final "value" entry: an ``nnx.Variable``'s own array attribute is not part of a
parameter's name.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["path_parts", "path_name"]


def _entry_text(entry: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def path_parts(path: Sequence[Any], strip_value: bool = False) -> tuple[str, ...]:
    """('model', 'layers', '0', 'mlp', 'up_proj', 'kernel') from a key path."""
    parts = tuple(_entry_text(entry) for entry in path)
    if strip_value and parts and parts[-1] == "value":
        parts = parts[:-1]
    return parts


def path_name(path: Sequence[Any], strip_value: bool = False) -> str:
    """'model.layers.0.mlp.up_proj.kernel': :func:`path_parts` joined by dots."""
    return ".".join(path_parts(path, strip_value))
