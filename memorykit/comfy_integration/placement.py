"""The one rule Group Offload and Balanced Device Map follow for what they do to the shared model.

Every clone of a MODEL shares one ``BaseModel``. When ComfyUI loads one of the pack's patchers,
it changes that module for all of them (hooks, weights streamed, placeholders for weights that
live elsewhere): a *placement*. It is recorded on the BaseModel (one at a time) with the patcher
that owns it, and follows this rule (both patcher classes get their load/unload/detach lifecycle
from :class:`PlacementPatcher`, which calls the functions below):

- **reuse**: a patcher being loaded keeps the placement when its key (settings, weight-patch
  uuid, device) is the placement's key (:func:`reuse`): it re-applies its own object patches
  (``ModelSamplingDiscrete``, ...), as ComfyUI's ``partially_load`` does for a loaded model, and
  becomes the owner. Otherwise the placement is undone (:func:`remove`) and applied again
  (:func:`install`).
- **detach**: only the owner's detach undoes it (:func:`detach_unpatch_all`). ComfyUI detaches
  with ``unpatch_all=False`` both the loaded clone of a model it is about to load
  (``load_models_gpu``) and any clone being garbage-collected (``ModelPatcher.__del__``); the
  owner keeps the placement in the first case only when the patcher about to load is one of the
  pack's, which marks the hand-over in its ``is_clone`` (:func:`mark_handover`).
- **collection**: the owner's garbage collection undoes the placement, unless another patcher
  took it over.
- **readers**: a node that reads the shared weights while a placement may be applied (e.g. FP8
  Layerwise Cast) calls :func:`release` first; a node that has ComfyUI load the model to read
  it (Save Sharded: core's savers call ``load_models_gpu``) does so inside :func:`plain_load`.
- **failure**: whatever raises while a placement is applied, the model is put back as it was
  (:meth:`PlacementPatcher._place`, :class:`memorykit.module_state.ModuleState`); an undo that
  raises half-way is finished (:func:`remove`). :data:`fault_hook` lets tests fail on purpose.
- **blocks**: every placement sees the same blocks (:func:`comfy_block_lists`): Group Offload
  streams them, Balanced Device Map never splits them.
"""
from __future__ import annotations

import contextlib
import logging
import weakref

import torch

from .. import stored_parts
from ..module_state import ModuleState
from ..offload_plan import BlockLists, block_lists

_log = logging.getLogger("MemoryKit")
_ATTR = "_memorykit_placement"

# Test hook (documented for the tests that make a placement fail; None in use): called with
# "installed" right after a placement is recorded on the model (everything applied, the rest of
# the load still to run) and with "undo" half-way through undoing one (see Placement.undo).
# Whatever it raises is a failure at that point.
fault_hook = None


def fault_point(stage: str) -> None:
    """Run :data:`fault_hook` for ``stage`` (nothing in use)."""
    if fault_hook is not None:
        fault_hook(stage)


def comfy_block_lists(diffusion_model) -> BlockLists:
    """The blocks of a ComfyUI diffusion model, for every placement (Group Offload streams them,
    Balanced Device Map keeps each whole): :func:`memorykit.offload_plan.block_lists` (diffusers'
    block_level rule), with the elements of a ``TimestepEmbedSequential`` (SD/SDXL UNets) as the
    blocks, because ComfyUI's ``forward_timestep_embed`` calls those layers directly and never
    the container's forward."""
    from comfy.ldm.modules.diffusionmodules.openaimodel import TimestepEmbedSequential
    return block_lists(diffusion_model, (TimestepEmbedSequential,))


def comfy_block_names(diffusion_model) -> list[str]:
    """Qualified names of the blocks of :func:`comfy_block_lists`, in module order."""
    return [qn for _, items in comfy_block_lists(diffusion_model) for qn, _ in items]


class Placement:
    """One applied placement; subclasses hold what undoing it needs and implement :meth:`undo`.

    ``key``: what the placement was made for (compared with ``==`` by :func:`reuse`).
    ``memory_path``: how Memory Report names a model with this placement applied.
    """

    memory_path = "MemoryKit placement"

    def __init__(self, key: tuple):
        self.key = key
        self.owner_id: int | None = None
        self.handover_to: int | None = None  # id of the owner whose next detach(False) keeps it
        self._owner = None                   # weakref to the owner
        self._finalizer = None

    def undo(self, base_model) -> None:
        """Put ``base_model`` back as it was before the placement (weights, hooks, counters).

        Must be resumable: when it raised half-way, calling it again finishes the job (each
        step skips what is done); :func:`remove` relies on it. Calls :func:`fault_point`
        ("undo") between its steps."""
        raise NotImplementedError

    def owner(self):
        """The owning patcher, or None when it was collected."""
        return self._owner() if self._owner is not None else None


def applied(base_model) -> Placement | None:
    """The placement applied to ``base_model`` (a ComfyUI BaseModel) now, or None."""
    return base_model.__dict__.get(_ATTR)


def memory_path(base_model) -> str | None:
    """Memory Report's name for the placement applied to ``base_model`` now, or None."""
    p = applied(base_model)
    return p.memory_path if p is not None else None


def owns(patcher) -> bool:
    """True when ``patcher`` owns the placement applied to its model."""
    p = applied(patcher.model)
    return p is not None and p.owner_id == id(patcher)


def _finalize(base_model, placement, owner_id) -> None:
    p = applied(base_model)
    if p is placement and p.owner_id == owner_id:
        remove(base_model)


# The attachment each placement node sets on its MODEL clone, and → the node's name.
GROUP_OFFLOAD_KEY = "memorykit_group_offload"
DEVICE_MAP_ATTACHMENT = "memorykit_device_map"
PLACED_BY = {GROUP_OFFLOAD_KEY: "Group Offload", DEVICE_MAP_ATTACHMENT: "Balanced Device Map"}
PLANNED_KEY = "memorykit_memory_plan"  # set by Memory Plan on the MODEL it placed with Group Offload's code


def placed_by(patcher) -> str | None:
    """The name of the node (Group Offload, Balanced Device Map, or Memory Plan where it applied
    Group Offload's code) ``patcher``'s MODEL comes through, as the user's graph shows it, or
    None: such a MODEL already has its weights' places decided."""
    name = next((name for key, name in PLACED_BY.items() if patcher.get_attachment(key) is not None), None)
    return "Memory Plan" if name is not None and patcher.get_attachment(PLANNED_KEY) is not None else name


def _take_ownership(patcher, p: Placement) -> None:
    if p._finalizer is not None:
        p._finalizer.detach()
    p.owner_id, p._owner, p.handover_to = id(patcher), weakref.ref(patcher), None
    p._finalizer = weakref.finalize(patcher, _finalize, patcher.model, p, id(patcher))
    p._finalizer.atexit = False  # at exit only files matter; their owners delete them


def install(patcher, p: Placement) -> None:
    """Record ``p`` (just applied by ``patcher``) on the model, owned by ``patcher``. Raises
    RuntimeError when another placement is still applied (remove it first)."""
    if applied(patcher.model) is not None:
        raise RuntimeError("MemoryKit: a placement is already applied to this model; remove it first")
    patcher.model.__dict__[_ATTR] = p
    _take_ownership(patcher, p)
    fault_point("installed")


def remove(base_model) -> bool:
    """Undo the placement applied to ``base_model``, whoever owns it; False when there is none."""
    p = base_model.__dict__.pop(_ATTR, None)
    if p is None:
        return False
    if p._finalizer is not None:
        p._finalizer.detach()
    _undo(base_model, p)
    return True


def _undo(base_model, p: Placement) -> None:
    """``p.undo`` carried to the end: when it raises half-way it runs once more (undo is
    resumable), so an unload that fails still leaves the model as it was before the placement.
    An interrupt is raised again after that; an error only when the second run fails too."""
    try:
        with torch.inference_mode(stored_parts.inference_weights(base_model)):  # as the weights were loaded
            p.undo(base_model)
        return
    except BaseException as e:  # noqa: BLE001 - finished below, then raised again if it was an interrupt
        first = e
    _log.warning("MemoryKit: undoing the %s placement raised (%s: %s); finishing it", type(p).__name__,
                 type(first).__name__, first)
    try:
        p.undo(base_model)
    except BaseException as e:
        raise RuntimeError(f"MemoryKit could not put this model back after a failure while removing its placement "
                           f"({type(first).__name__}: {first}); reload the model (change the loader's file or "
                           "restart ComfyUI) before the next run.") from e
    if not isinstance(first, Exception):
        raise first


def reapply_object_patches(patcher) -> None:
    """Swap the object patches in the model for ``patcher``'s own, weights untouched (what
    ComfyUI's ``partially_load`` does for a model that is already loaded)."""
    with patcher.use_ejected(skip_and_inject_on_exit_only=True):
        patcher.unpatch_model(None, unpatch_weights=False)  # restores the previous clone's (shared backup)
        patcher.patch_model(load_weights=False)
    patcher.apply_hooks(patcher.forced_hooks, force_apply=True)


def reuse(patcher, key: tuple, kind: type) -> bool:
    """Reuse the placement applied to ``patcher``'s model when it is a ``kind`` made for ``key``:
    ``patcher`` becomes its owner and its object patches are applied. Returns False (nothing
    changed) when there is no such placement."""
    p = applied(patcher.model)
    if not isinstance(p, kind) or p.key != key:
        return False
    _take_ownership(patcher, p)
    reapply_object_patches(patcher)
    return True


def mark_handover(patcher, other) -> None:
    """From ``patcher.is_clone(other)`` (``load_models_gpu`` is about to load ``patcher`` and to
    detach ``other``): ``other``'s next ``detach(unpatch_all=False)`` keeps the placement,
    because ``patcher``'s load reuses or replaces it."""
    p = applied(patcher.model)
    if p is not None:
        p.handover_to = id(other)


def detach_unpatch_all(patcher, unpatch_all: bool) -> bool:
    """The ``unpatch_all`` ``patcher.detach`` must pass on to ComfyUI's detach.

    Owner: True (undo everything, placement included) unless this is the marked hand-over
    (``unpatch_all=False`` after :func:`mark_handover`). Any other patcher: False — the loaded
    model is not its to undo (e.g. a clone being collected). No placement: ``unpatch_all``.
    """
    p = applied(patcher.model)
    if p is None:
        return unpatch_all
    if p.owner_id != id(patcher):
        return False
    keep = not unpatch_all and p.handover_to == id(patcher)
    p.handover_to = None
    return not keep


_PLAIN = "_memorykit_plain_load"


@contextlib.contextmanager
def plain_load(patcher):
    """Within: any placement on ``patcher``'s model is released and the pack's patchers load
    ``patcher`` the plain way (ComfyUI's own load, real weights), as they do for
    ``force_patch_weights``. Used to save a placed model (issue 23 items 4 and 11)."""
    release(patcher.model)
    patcher.__dict__[_PLAIN] = True
    try:
        yield
    finally:
        patcher.__dict__.pop(_PLAIN, None)


def wants_plain_load(patcher) -> bool:
    """True inside :func:`plain_load` for ``patcher``."""
    return bool(patcher.__dict__.get(_PLAIN))


def release(base_model) -> bool:
    """Undo any placement on ``base_model`` so its weights can be read (called by nodes that read
    the shared module). The owner is detached as ComfyUI unloads a model (weight patches and
    object patches undone too); it re-applies the placement when ComfyUI loads it next.
    Returns False when nothing was applied."""
    p = applied(base_model)
    if p is None:
        return False
    owner = p.owner()
    if owner is not None:
        p.handover_to = None
        owner.detach(unpatch_all=True)
    remove(base_model)  # no-op when the owner's detach removed it
    return True


class PlacementPatcher:
    """The lifecycle every placement's ModelPatcher follows: a mixin over a ModelPatcher class
    (Group Offload's ``GroupOffloadModelPatcher``, Balanced Device Map's ``DeviceMap<Base>``).

    A subclass says what it places and how; this class decides when, following the rule of this
    module (reuse, hand-over, detach, collection):

    - :meth:`_placement_plan` ``(device_to, force_patch_weights)``: what to apply for this load,
      or None for ComfyUI's own load (any placement is removed first);
    - :meth:`_placement_key` ``(plan, device_to)``: the key a reusable placement carries;
    - ``_placement_kind``: the :class:`Placement` subclass it installs;
    - ``_placement_store``: where the weights wait while unloaded (default: the offload device);
    - :meth:`_apply_placement` ``(device_to, plan, memory, force_patch_weights)``: apply it to
      the model ComfyUI has just put in its unloaded state (weights unpatched, object patches
      applied) and :func:`install` it.
    """

    _placement_kind: type = Placement

    def _placement_plan(self, device_to, force_patch_weights):
        raise NotImplementedError

    def _placement_key(self, plan, device_to) -> tuple:
        raise NotImplementedError

    def _apply_placement(self, device_to, plan, memory, force_patch_weights) -> None:
        raise NotImplementedError

    def _placement_store(self):
        return self.offload_device

    def _core_load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
        """ComfyUI's own ``load`` of the patcher class below this mixin (keywords: ComfyUI-GGUF's
        ``load`` takes ``force_patch_weights`` as a keyword only)."""
        return super().load(device_to, lowvram_model_memory=lowvram_model_memory,
                            force_patch_weights=force_patch_weights, full_load=full_load)

    def _place(self, device_to, plan, memory, force_patch_weights) -> None:
        """Apply ``plan`` from ComfyUI's unloaded state. The one failure rule of every placement:
        whatever raises while it is applied (the technique, core's load inside it, a callback, an
        interrupt), the model ComfyUI holds is put back as it was — unloaded, every weight with its
        own values on the offload device, no hook, file or placement left — and the error raised."""
        self.unpatch_model(self._placement_store(), unpatch_weights=True)
        self.patch_model(load_weights=False)
        state = ModuleState(self.model)  # references only; dropped once the placement is applied
        try:
            self._apply_placement(device_to, plan, memory, force_patch_weights)
        except BaseException:
            self._restore_after_failure(state)
            raise

    def _restore_after_failure(self, state: ModuleState) -> None:
        try:
            remove(self.model)  # the technique's own undo when it got as far as installing (files, pinned memory)
        except BaseException:  # noqa: BLE001 - the state below is put back whatever happened
            _log.exception("MemoryKit: undoing a placement that failed to load raised")
        state.restore()  # tensors, hooks and attributes the technique left
        self.detach()    # ComfyUI's bookkeeping: weight patches (LoRA) and object patches undone, counters reset

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
        plan = self._placement_plan(device_to, force_patch_weights)
        if plan is None:
            remove(self.model)
            return super().load(device_to, lowvram_model_memory=lowvram_model_memory,
                                force_patch_weights=force_patch_weights, full_load=full_load)
        with self.use_ejected(skip_and_inject_on_exit_only=True):
            self._place(device_to, plan, lowvram_model_memory or 1e32, force_patch_weights)

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        plan = self._placement_plan(device_to, force_patch_weights)
        if plan is None:
            if applied(self.model) is not None:
                self.unpatch_model(self.offload_device, unpatch_weights=True)
            return super().partially_load(device_to, extra_memory, force_patch_weights)
        if not force_patch_weights and reuse(self, self._placement_key(plan, device_to), self._placement_kind):
            return 0
        with self.use_ejected(skip_and_inject_on_exit_only=True):
            before = self.model.model_loaded_weight_memory
            self._place(device_to, plan, extra_memory, force_patch_weights)
        return max(0, self.model.model_loaded_weight_memory - before)

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
        if applied(self.model) is not None:
            return 0  # a placement is removed whole (ComfyUI then unloads the model: detach), never in part
        return super().partially_unload(device_to, memory_to_free, force_patch_weights)

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        if unpatch_weights:
            remove(self.model)
        return super().unpatch_model(device_to, unpatch_weights)

    def is_clone(self, other):
        # load_models_gpu is about to load this patcher and detach `other` with unpatch_all=False:
        # this patcher's partially_load reuses or replaces the placement, so that detach may keep it.
        same = super().is_clone(other)
        if same:
            mark_handover(self, other)
        return same

    def clone(self, *args, **kwargs):
        n = super().clone(*args, **kwargs)
        if type(n) is not type(self) and isinstance(self, type(n)):
            n.__class__ = type(self)  # ComfyUI-GGUF's clone makes every clone a plain GGUFModelPatcher
        return n

    def detach(self, unpatch_all=True):
        # The owner's full detach: the placement undone (weights back where they were), then
        # ComfyUI's full unpatch so its bookkeeping (patched weights, loaded size) matches.
        with torch.inference_mode(stored_parts.inference_weights(self.model)):  # core's full unpatch moves the weights
            return super().detach(detach_unpatch_all(self, unpatch_all))
