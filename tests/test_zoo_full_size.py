"""Full-size planning check on the meta device (no memory): for every published configuration
in ``harness.meta_models.PLANNING``, the block lists Group Offload streams
(``comfy_block_lists``) and the blocks Balanced Device Map keeps whole hold ≥ 95 % of the
weights, so neither technique leaves most of a model resident. Prints the table
(arch, params, % in blocks), the figures of docs/models.md."""
from __future__ import annotations

import pytest
from harness import meta_models

MIN_SHARE = 0.95
_ROWS: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def table():
    yield
    if _ROWS:
        print("\narch | params | % in Group Offload blocks | % in device-map blocks\n" + "\n".join(_ROWS.values()))


@pytest.mark.parametrize("kind", sorted(meta_models.PLANNING))
def test_block_lists_hold_95_percent_of_the_weights(comfy, kind):
    from comfyui_memorykit.memorykit import comfy_integration as ci
    from comfyui_memorykit.memorykit import device_map as dmap
    from comfyui_memorykit.memorykit.offload_plan import tensor_bytes as _bytes
    try:
        patcher = meta_models.meta_patcher(kind)
    except LookupError as e:
        pytest.skip(str(e))
    dm = patcher.model.diffusion_model
    total = _bytes(list(dm.parameters()) + list(dm.buffers()))
    streamed = _bytes(t for _, bl in ci.comfy_block_lists(dm) for _, b in bl
                      for t in list(b.parameters()) + list(b.buffers()))
    whole = _bytes(t for name in dmap.model_blocks(dm)  # device_map's rule on its own (no ComfyUI containers)
                   for m in [dm.get_submodule(name)] for t in list(m.parameters()) + list(m.buffers()))
    params = sum(p.numel() for p in dm.parameters())
    _ROWS[kind] = f"{kind} | {params / 1e9:.2f} B | {streamed / total:.1%} | {whole / total:.1%}"
    assert streamed >= MIN_SHARE * total, _ROWS[kind]
    assert whole >= MIN_SHARE * total, _ROWS[kind]
