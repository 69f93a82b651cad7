"""Helpers for building node schemas that work across ComfyUI versions."""
from __future__ import annotations

import dataclasses

from comfy_api.latest import io

CATEGORY = "MemoryKit"


def supports_search_aliases() -> bool:
    """True when this ComfyUI's ``io.Schema`` has a ``search_aliases`` field.

    ComfyUI 0.3.75 has none (its node search, frontend 1.32, matches only the node id and the
    display name); newer versions send ``search_aliases`` to the editor's node search.
    """
    return "search_aliases" in {f.name for f in dataclasses.fields(io.Schema)}


def make_schema(*, search_aliases: list[str] | None = None, **fields) -> io.Schema:
    """``io.Schema(**fields)``, plus ``search_aliases`` where this ComfyUI supports them.

    ``search_aliases``: extra words the editor's node search finds the node by (e.g.
    ``["offload", "lowvram"]``); silently dropped on versions without the field. The category
    defaults to ``MemoryKit``.
    """
    fields.setdefault("category", CATEGORY)
    if search_aliases and supports_search_aliases():
        fields["search_aliases"] = list(search_aliases)
    return io.Schema(**fields)


class PassthroughNode(io.ComfyNode):
    """Base of nodes that take any value (input ``value``) and pass it through (output
    ``passthrough``), running on every queue: memory changes between runs even when the inputs
    do not."""

    @classmethod
    def validate_inputs(cls, input_types=None, **kwargs) -> bool:
        # Accepting `input_types` tells ComfyUI to skip its type check: this input takes any type.
        return True

    @classmethod
    def fingerprint_inputs(cls, **kwargs):
        # A new NaN object each call, as core's own always-run nodes do (float("NaN")): ComfyUI's
        # cache compares fingerprints inside a dict key, where the one shared `math.nan` object
        # matches itself by identity, so the node was reused from the cache, never re-run.
        return float("nan")
