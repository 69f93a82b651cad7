"""Every technique on every diffusion architecture of the tested ComfyUI (the zoo,
``tests/harness/zoo.py``), in-process, each against the plain forward through
``BaseModel.apply_model``:

- Group Offload, event ring on the CPU (``memorykit.offload.apply_group_offload``, RAM target:
  the schedule the GPU runs, copies are memcpys), block_level and leaf_level: bit-exact;
- Group Offload to disk through the integration (``prepare_group_offload`` + ComfyUI's
  ``load_models_gpu``), block_level and leaf_level: bit-exact;
- Balanced Device Map through the integration (``device_map_model``), cpu for half the
  weights + disk: bit-exact;
- FP8 Layerwise Cast through the integration (``fp8_layerwise_cast``): finite, relative L2
  error bounded; the share of weight bytes cast is printed.

One built model per architecture (a module-scoped parametrized fixture, so pytest runs the
cases of one architecture together), one forward per case. The figures land in a table
printed at the end (and written as JSON to ``$MEMORYKIT_ZOO_TABLE`` when set, the source of
``docs/models.md``).
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from harness import zoo

FP8_MAX_REL = 0.1  # relative L2 error of the diffusion model's output; measured 0.00-0.04 on the zoo (docs/models.md)
# Known failures fixed on this branch (the marks go with the fix).
_FIGURES: dict[str, dict[str, str]] = {}


class Arch:
    """One zoo model, its inputs and its plain output."""

    def __init__(self, name: str):
        self.name = name
        self.patcher = zoo.build(name)
        self.base = self.patcher.model
        self.dm = self.base.diffusion_model
        self.args = zoo.inputs(name, self.base)
        self.reference, self.raw_reference = self.forward_raw()
        assert torch.isfinite(self.reference).all(), f"{name}: the plain forward is not finite"
        self.snapshot = {k: v.clone() for k, v in self.dm.state_dict().items()}
        self.nbytes = sum(t.numel() * t.element_size() for t in self.snapshot.values())

    def forward(self, patcher=None) -> torch.Tensor:
        return zoo.forward(patcher or self.base, self.name, self.args)

    def forward_raw(self, patcher=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``apply_model``'s output and the diffusion model's own output inside it (before
        ComfyUI's model sampling mixes the input back in, which would hide an error)."""
        raw = []
        hook = self.dm.register_forward_hook(lambda m, a, out: raw.append(out))
        try:
            out = self.forward(patcher)
        finally:
            hook.remove()
        return out, raw[-1].float()

    def assert_restored(self) -> None:
        """Weights as built: same values, on the CPU, no hook left."""
        now = self.dm.state_dict()
        assert now.keys() == self.snapshot.keys()
        for k, v in self.snapshot.items():
            assert now[k].device.type == "cpu" and torch.equal(now[k], v), k
        for n, m in self.dm.named_modules():
            assert not m._forward_pre_hooks and not m._forward_hooks, n
            assert "_hf_hook" not in m.__dict__ and "_diffusers_hook" not in m.__dict__, n


def _record(arch: Arch, case: str, text: str) -> None:
    _FIGURES.setdefault(arch.name, {})[case] = text


def _exact(arch: Arch, case: str, out: torch.Tensor) -> None:
    diff = float((out.float() - arch.reference.float()).abs().max()) if out.shape == arch.reference.shape else float("nan")
    _record(arch, case, "exact" if torch.equal(out, arch.reference) else f"max abs {diff:.3g}")
    assert torch.equal(out, arch.reference), f"{arch.name} {case}: max abs difference {diff}"


@pytest.fixture(scope="module", params=zoo.ARCHS)
def arch(request, comfy):
    why = zoo.available(request.param)
    if why:
        pytest.skip(why)
    import comfy.model_management as mm
    mm.unload_all_models()
    a = Arch(request.param)
    yield a
    mm.unload_all_models()


@pytest.fixture(scope="module", autouse=True)
def figures_table():
    yield
    if not _FIGURES:
        return
    cases = ["ring block_level", "ring leaf_level", "disk block_level", "disk leaf_level", "device map", "fp8"]
    lines = ["", "arch | " + " | ".join(cases)]
    for name in zoo.ARCHS:
        if name in _FIGURES:
            lines.append(f"{name} | " + " | ".join(_FIGURES[name].get(c, "-") for c in cases))
    print("\n".join(lines))
    path = os.environ.get("MEMORYKIT_ZOO_TABLE")
    if path:
        import comfyui_version
        with open(path, "w") as f:
            json.dump({"comfyui": comfyui_version.__version__, "figures": _FIGURES}, f, indent=1)


def _loaded_forward(arch: Arch, patcher) -> torch.Tensor:
    """Load ``patcher`` as sampling does (``load_models_gpu``), one forward, then unload all."""
    import comfy.model_management as mm
    try:
        mm.load_models_gpu([patcher])
        return arch.forward(patcher)
    finally:
        mm.unload_all_models()


@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_event_ring_is_bit_exact(arch, offload_type):
    from comfyui_memorykit.memorykit import comfy_integration as ci
    from comfyui_memorykit.memorykit import offload
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    opts = GroupOffloadOptions(offload_type=offload_type, offload_to="cpu", exclude_kwargs=("transformer_options",))
    h = offload.apply_group_offload(arch.dm, "cpu", "cpu", options=opts, block_lists=ci.comfy_block_lists(arch.dm))
    try:
        assert h.plan.streamed_blocks or offload_type == "leaf_level"
        out = arch.forward()
        if arch.name == "ace_step" and offload_type == "block_level":  # unused at inference: left alone
            assert offload.offload_figures(h)["never_ran_blocks"] == ["projectors.0", "projectors.1"]
    finally:
        offload.remove_group_offload(h)
    arch.assert_restored()
    _exact(arch, f"ring {offload_type}", out)


@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_disk_offload_is_bit_exact(arch, offload_type, tmp_path):
    from comfyui_memorykit.memorykit import comfy_integration as ci
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    settings = ci.GroupOffloadSettings(GroupOffloadOptions(offload_type=offload_type, offload_to="disk"),
                                       disk_folder=str(tmp_path))
    n, _ = ci.prepare_group_offload(arch.patcher, settings)
    out = _loaded_forward(arch, n)
    assert os.listdir(tmp_path) == []
    arch.assert_restored()
    _exact(arch, f"disk {offload_type}", out)


def test_device_map_cpu_and_disk_is_bit_exact(arch, tmp_path):
    from comfyui_memorykit.memorykit import comfy_integration as ci
    blocks = [qn for _, items in ci.comfy_block_lists(arch.dm) for qn, _ in items]
    in_blocks = sum(t.numel() * t.element_size() for b in blocks for t in arch.dm.get_submodule(b).state_dict().values())
    cpu = arch.nbytes - in_blocks // 2  # what lies outside the blocks and half the blocks: both devices used
    clone, rep, _ = ci.device_map_model(arch.patcher, "balanced", f"cpu={cpu}, disk", str(tmp_path))
    per = rep["bytes_per_device"]
    assert per.get("cpu", 0) <= cpu, f"{arch.name}: plan puts {per.get('cpu')} B on cpu against cpu={cpu}B"
    assert set(per) == {"cpu", "disk"}, f"{arch.name}: {per} (blocks: {blocks})"
    out = _loaded_forward(arch, clone)
    assert os.listdir(tmp_path) == []
    arch.assert_restored()
    _exact(arch, "device map", out)


def test_fp8_layerwise_cast_error_is_bounded(arch):
    import comfy.model_management as mm
    from comfyui_memorykit.memorykit import comfy_integration as ci
    with torch.inference_mode():
        model, info = ci.fp8_layerwise_cast(arch.patcher)
    try:
        with torch.inference_mode():
            mm.load_models_gpu([model])
            out, raw = arch.forward_raw(model)
    finally:
        mm.unload_all_models()
    arch.assert_restored()
    share = info["cast_params"] * 4 / info["weight_bytes_before"]  # the zoo is float32: 4 bytes a weight
    err = float((raw - arch.raw_reference).norm() / arch.raw_reference.norm())
    _record(arch, "fp8", f"rel {err:.2g}, {share:.0%} bytes cast")
    print(f"\n{arch.name}: fp8 e4m3 relative L2 error {err:.4f}, {share:.1%} of weight bytes cast "
          f"({info['cast_layers']} layers cast, {len(info['kept_layers'])} kept)")
    assert torch.isfinite(out).all() and torch.isfinite(raw).all()
    assert err < FP8_MAX_REL, f"{arch.name}: fp8 relative error {err}"


def test_device_map_over_max_memory_is_a_clear_error(comfy, tmp_path):
    """PixArt Sigma's tensors outside the blocks (embedders, tokens) stay on the compute device:
    a cpu budget below them is refused before anything is applied, naming cpu and the shortfall."""
    from comfyui_memorykit.memorykit import comfy_integration as ci
    patcher = zoo.build("pixart_sigma")
    with pytest.raises(ValueError, match=r"max_memory cpu=.* is too small: the plan needs .* on cpu .* more\. Raise cpu"):
        ci.device_map_model(patcher, "balanced", "cpu=16KiB, disk", str(tmp_path))
    assert os.listdir(tmp_path) == []
