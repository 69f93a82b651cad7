"""The modules a ModelPatcher's MODEL has, as that MODEL sees them: one rule for every node that
inspects a model (Memory Plan's figures, FP8 Layerwise Cast's layer plan, Balanced Device Map's
and Group Offload's sizes).

Clones of one loaded model share its ``BaseModel``. While ComfyUI keeps another clone loaded
(after its prompt, until something evicts it), that clone's object patches are applied to the
shared modules: FP8 Layerwise Cast's float8 layers sit in the tree, and a node reading
``patcher.model.diffusion_model`` of a plain clone saw "already float8" layers and their byte
sizes (Memory Plan decided differently after an FP8 prompt; a plan queued after one sampled the
wrong model). :func:`own_module` gives a view of the tree with this patcher's own object patches
and, where another loaded clone's patch is applied, the original module behind it. The view is
built from shallow copies of the modules on the paths to the swapped ones (parameters shared,
nothing moved or copied); the shared model is never changed.
"""
from __future__ import annotations

import copy

import torch


def _applied_by_others(patcher) -> dict[str, torch.nn.Module]:
    """``{key: original}`` for object patches that other clones of ``patcher``'s model have
    applied to the shared modules now (their ``object_patches_backup``)."""
    import comfy.model_management as mm
    out: dict[str, torch.nn.Module] = {}
    for lm in list(getattr(mm, "current_loaded_models", [])):
        other = getattr(lm, "model", None)
        if other is None or other is patcher or getattr(other, "model", None) is not patcher.model:
            continue
        out.update(getattr(other, "object_patches_backup", {}) or {})
    return out


def own_object(patcher, key: str):
    """The object at ``key`` (dotted, from the BaseModel: ``diffusion_model.blocks.0``) as
    ``patcher`` sees it: its own object patch, else the original behind another clone's applied
    patch, else what the tree holds."""
    import comfy.utils
    if key in patcher.object_patches:
        return patcher.object_patches[key]
    if key in patcher.object_patches_backup:
        return patcher.object_patches_backup[key]
    others = _applied_by_others(patcher)
    return others[key] if key in others else comfy.utils.get_attr(patcher.model, key)


def own_module(patcher, key: str = "diffusion_model") -> torch.nn.Module:
    """The module at ``key`` as ``patcher``'s MODEL has it (see the module docstring): the
    tree itself when nothing differs, else a view whose swapped modules are this patcher's own
    object patches or the originals behind another loaded clone's patches."""
    swaps = {k: v for k, v in _applied_by_others(patcher).items() if k.startswith(key + ".")}
    swaps.update({k: v for k, v in patcher.object_patches.items() if k.startswith(key + ".")})
    root = own_object(patcher, key)
    if not swaps:
        return root
    swaps = {k[len(key) + 1:]: v for k, v in swaps.items() if isinstance(v, torch.nn.Module)}
    copies: dict[str, torch.nn.Module] = {}

    def view(path: str) -> torch.nn.Module:  # a shallow copy of the module at path, its children its own dict
        if path in copies:
            return copies[path]
        if path == "":
            new = copy.copy(root)
        else:
            parent_path, _, name = path.rpartition(".")
            parent = view(parent_path)
            new = copy.copy(parent._modules[name])
            parent._modules[name] = new
        new.__dict__["_modules"] = dict(new._modules)
        copies[path] = new
        return new

    for path, module in sorted(swaps.items(), key=lambda kv: kv[0].count(".")):
        parent_path, _, name = path.rpartition(".")
        try:
            parent = view(parent_path)
        except KeyError:  # a path the tree does not have (a patch of another shape): nothing to swap
            continue
        if name in parent._modules:
            parent._modules[name] = module
    return copies.get("", root)
