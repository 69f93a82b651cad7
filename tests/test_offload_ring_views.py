"""Event ring, leaf_level (issue 14 item 10): weights read without their module's forward, and
parameters that alias ring regions outside the forward.

A parent that reads a leaf's weight without calling the leaf (``nn.MultiheadAttention``
reads ``out_proj.weight``; ``F.linear(x, self.proj.weight)``) gets no pre-hook, so the ring
could not order the read after the copy: such leaves are found in the first forward and kept
resident. Parameters point at ring views only while their group's forward runs, so a
reference taken between forwards (model merging, LoRA key patches) holds the real values,
never a region a later group overwrites. On the CPU the ring runs the same schedule.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn


# plain torch modules and the technique layer: no ComfyUI code runs (checked once, on the newest core)
pytestmark = pytest.mark.core_independent


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)  # reads out_proj.weight directly
        self.proj = nn.Linear(32, 32)   # read through F.linear, never called
        self.fc = nn.Linear(32, 32)     # called

    def forward(self, x):
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return x + self.fc(F.gelu(F.linear(x, self.proj.weight, self.proj.bias)))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _apply(net, ring_groups):
    from comfyui_memorykit.memorykit import offload
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    opts = GroupOffloadOptions(offload_type="leaf_level", offload_to="cpu", ring_groups=ring_groups)
    return offload.apply_group_offload(net, "cpu", "cpu", options=opts)


def _aliases(h, net) -> list[str]:
    ring = h.ring.ring.untyped_storage().data_ptr()
    return [n for n, t in list(net.named_parameters()) + list(net.named_buffers())
            if t.untyped_storage().data_ptr() == ring]


def test_leaves_read_without_forward_stay_resident_and_correct(comfy):
    from comfyui_memorykit.memorykit import offload
    torch.manual_seed(0)
    net = _Net().eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        ref = net(x)
    before = {n: t.detach().clone() for n, t in net.state_dict().items()}
    h = _apply(net, ring_groups=3)
    try:
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(net(x), ref)
        figures = h.ring.figures()
        # per block: attn.out_proj and proj never ran their forward (fc and the norms-free rest did)
        assert figures["resident_groups"] == 6, figures
        for b in net.blocks:
            for leaf in (b.attn.out_proj, b.proj):
                assert leaf.weight.untyped_storage().data_ptr() != h.ring.ring.untyped_storage().data_ptr()
                assert all(g.state == "resident" for g in h.ring.groups if leaf in g.modules)
    finally:
        offload.remove_group_offload(h)
    assert all(torch.equal(t, before[n]) for n, t in net.state_dict().items())


def test_no_parameter_aliases_a_ring_region_outside_the_forward(comfy):
    from comfyui_memorykit.memorykit import offload
    torch.manual_seed(1)
    net = _Net().eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        ref = net(x)
    h = _apply(net, ring_groups=2)
    try:
        inside = []
        hook = net.blocks[1].fc.register_forward_pre_hook(  # runs after the ring's pre-hook
            lambda m, a: inside.append(m.weight.untyped_storage().data_ptr()))
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(net(x), ref)
                assert _aliases(h, net) == []  # between forwards: every tensor holds its own values
        hook.remove()
        ring = h.ring.ring.untyped_storage().data_ptr()
        assert inside and all(p == ring for p in inside)  # inside the forward: the ring view
        kept = net.blocks[0].fc.weight.detach()  # a reference taken outside the forward
        saved = kept.clone()
        with torch.no_grad():
            net(x)
        assert torch.equal(kept, saved)  # not overwritten by later groups
    finally:
        offload.remove_group_offload(h)
