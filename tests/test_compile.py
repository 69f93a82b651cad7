"""torch.compile over the pack's layers and hooks (issue 14 item 15), dynamo level.

A counting backend (``torch._dynamo.testing.CompileCounter``: every graph dynamo hands to a
backend) and dynamo's own graph-break counter measure what our code costs: FP8 cast layers
must trace without a graph break, with dynamic shapes too (``min(sizes, key=sizes.get)``
broke the graph at every float8 Linear: 10 graphs and a break before, 3 graphs after). The
event ring under compile: re-applying the offload after an unload, more times than dynamo's
recompile limit, compiles nothing new, and the ring still schedules (a guard: this passed
before the fix too; dynamo traces the ring's hooks, guarding on the groups' states).
"""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def dynamo():
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    yield CompileCounter(), counters
    torch._dynamo.reset()


def _breaks(counters) -> int:
    return sum(counters["graph_break"].values())


def test_fp8_cast_layers_trace_without_graph_breaks(ci, fp8, dynamo):
    """ComfyUI cast ops made float8 by the node (Linear and Conv2d, every scaling, fp16 and
    fp32 compute) in one compiled module, called with changing shapes (dynamic after the first
    recompile): one graph per shape specialisation, zero graph breaks, same values as eager."""
    import comfy.ops
    cc, counters = dynamo
    torch.manual_seed(0)
    layers = []
    for scaling in fp8.SCALINGS:
        conv = comfy.ops.manual_cast.Conv2d(4, 4, 3, padding=1)
        lin = comfy.ops.manual_cast.Linear(4, 4)
        for orig in (conv, lin):
            torch.nn.init.normal_(orig.weight, std=0.02)
            torch.nn.init.normal_(orig.bias, std=0.02)  # ComfyUI ops leave parameters uninitialised
            q, s = fp8.quantize_weight(orig.weight, torch.float8_e4m3fn, scaling)
            layers.append(ci.fp8_patcher._fp8_layer(orig, q, s, orig.bias.detach().clone()))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(layers)

        def forward(self, x):
            for conv, lin in zip(self.layers[::2], self.layers[1::2]):
                x = lin(conv(x).movedim(1, -1)).movedim(-1, 1)
            return x

    net = Net()
    compiled = torch.compile(net, backend=cc)
    with torch.inference_mode():
        for dtype in (torch.float32, torch.float16):
            for hw in (8, 12, 16):
                x = torch.randn(1, 4, hw, hw, dtype=dtype)
                assert torch.allclose(compiled(x).float(), net(x).float(), rtol=1e-3, atol=1e-4)
    print(f"\nfp8 layers: {cc.frame_count} graphs, {_breaks(counters)} graph breaks")
    assert _breaks(counters) == 0, dict(counters["graph_break"])
    assert cc.frame_count <= 4  # float32 static, dynamic; float16 static, dynamic


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

    def forward(self, x):
        return x + self.b(torch.nn.functional.gelu(self.a(x)))


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(4))
        self.out = torch.nn.Linear(32, 8)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.out(x)


@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_event_ring_recompiles_nothing_after_unloads(comfy, dynamo, offload_type):
    from comfyui_memorykit.memorykit import offload
    from comfyui_memorykit.memorykit.offload_plan import GroupOffloadOptions
    cc, counters = dynamo
    torch.manual_seed(0)
    net = _Net().eval()
    x = torch.randn(2, 32)
    with torch.no_grad():
        ref = net(x)
    compiled = torch.compile(net, backend=cc)
    frames = []
    h = offload.apply_group_offload(net, "cpu", "cpu", block_lists=None,
                                    options=GroupOffloadOptions(offload_type=offload_type, offload_to="cpu"))
    with torch.no_grad():
        for _ in range(3):
            net(x)
    eager_copies = h.ring.copied_last_forward
    offload.remove_group_offload(h)
    limit = torch._dynamo.config.recompile_limit if hasattr(torch._dynamo.config, "recompile_limit") \
        else torch._dynamo.config.cache_size_limit
    for _ in range(limit + 2):  # load, sample, unload: more cycles than the recompile limit
        h = offload.apply_group_offload(net, "cpu", "cpu", block_lists=None,
                                        options=GroupOffloadOptions(offload_type=offload_type, offload_to="cpu"))
        try:
            assert h.ring is not None
            with torch.no_grad():
                for _ in range(3):
                    assert torch.equal(compiled(x), ref)
            # The ring really scheduled (hooks ran eagerly): forwards counted, the steady-state copies
            assert h.ring.forwards == 3 and h.ring.copied_last_forward == eager_copies
        finally:
            offload.remove_group_offload(h)
        frames.append(cc.frame_count)
    print(f"\nevent ring {offload_type}: graphs after each load {frames}, {_breaks(counters)} graph breaks")
    assert frames[-1] == frames[0], frames  # nothing compiled again after the first load
