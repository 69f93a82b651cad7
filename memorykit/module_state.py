"""What a placement may change on a torch module, recorded before it runs and put back when it
fails half-way. Plain torch.

A placement (group offloading, a device map) changes a module in place: it swaps tensors
(``param.data = ...``, new Parameters on the ``meta`` device, views of a disk file), adds hooks
and instance attributes (``forward``, ``_hf_hook``, ``_diffusers_hook``) and counters. When it
raises after some of that, its own clean-up may not reach everything (the tensors it already
replaced by ``meta`` placeholders have no values any more). :class:`ModuleState` records, by
reference only (no copy of any weight), each submodule's attributes, the contents of its dicts
and lists (parameters, buffers, children, hooks) and each tensor's data; :meth:`restore` puts
all of it back. The record keeps the original tensors alive: take it just before the change and
drop it when the change succeeded.
"""
from __future__ import annotations

import torch


class ModuleState:
    """The state of ``root`` and every submodule now (see the module notes)."""

    def __init__(self, root: torch.nn.Module):
        self._mods = []
        for m in root.modules():
            attrs = dict(m.__dict__)
            dicts = {k: list(v.items()) for k, v in attrs.items() if isinstance(v, dict)}
            lists = {k: list(v) for k, v in attrs.items() if isinstance(v, list)}
            data = {(k, n): t.data for k in ("_parameters", "_buffers")
                    for n, t in attrs.get(k, {}).items() if t is not None}
            self._mods.append((m, attrs, dicts, lists, data))

    def restore(self) -> None:
        """Every recorded module back to its recorded attributes, containers and tensor data;
        attributes added since are removed."""
        with torch.no_grad():
            for m, attrs, dicts, lists, data in self._mods:
                d = m.__dict__
                for k in [k for k in d if k not in attrs]:
                    del d[k]
                d.update(attrs)
                for k, items in dicts.items():
                    d[k].clear()
                    d[k].update(items)
                for k, items in lists.items():
                    d[k][:] = items
                for (k, n), t in data.items():
                    d[k][n].data = t  # the recorded object (its container was restored above)
