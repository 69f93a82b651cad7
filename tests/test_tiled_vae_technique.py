"""Tiled VAE technique layer on plain torch modules (no ComfyUI models): planning, blend
weights, one-pass tiling, shared GroupNorm statistics, global head/tail, memory fitting."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn


# plain torch modules and the technique layer: no ComfyUI code runs (checked once, on the newest core)
pytestmark = pytest.mark.core_independent


@pytest.fixture(scope="module")
def mk(comfy):
    from comfyui_memorykit.memorykit import (
        global_context,
        norm_stats,
        tiled_vae,
        tiling,
    )
    return type("MK", (), {"tiling": tiling, "tv": tiled_vae, "ns": norm_stats, "gc": global_context})


@pytest.mark.parametrize("n,tile,overlap", [(40, 24, 6), (44, 16, 4), (7, 8, 2), (100, 33, 32), (9, 2, 1)])
def test_plan_axis_covers_evenly_with_the_fewest_tiles(mk, n, tile, overlap):
    starts, length = mk.tiling.plan_axis(n, tile, overlap)
    assert length <= tile and starts[0] == 0 and starts[-1] + length == n
    assert len(starts) == (1 if n <= tile else -(-(n - overlap) // (tile - overlap)))  # fewest tiles
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert all(length - g >= overlap for g in gaps), (starts, length)
    assert not gaps or max(gaps) - min(gaps) <= 1  # evenly spread


def test_plan_for_2048px_with_512_64_tiles(mk):
    """The benchmark case: 256 latent units, tile 64, overlap 8 → 5 tiles of 58 (1.28× the pixels)."""
    assert mk.tiling.plan_axis(256, 64, 8) == ([0, 50, 99, 148, 198], 58)


@pytest.mark.parametrize("tile,overlap,match", [(0, 0, "tile"), (-8, 0, "tile"), (8, -1, "overlap"),
                                                (8, 8, "smaller"), (8, 9, "smaller")])
def test_plan_axis_rejects_bad_sizes(mk, tile, overlap, match):
    with pytest.raises(ValueError, match=match):
        mk.tiling.plan_axis(40, tile, overlap)


@pytest.mark.parametrize("amap", ["up8", "down8", "causal_up4", "causal_down4"])
@pytest.mark.parametrize("feather", [0.0, 0.25, 1.0])
def test_blend_weights_sum_to_one_and_skip_tile_borders(mk, amap, feather):
    AxisMap = mk.tiling.AxisMap
    m = {"up8": AxisMap.up(8), "down8": AxisMap.down(8), "causal_up4": AxisMap.up(4, causal=True),
         "causal_down4": AxisMap.down(4, causal=True)}[amap]
    plan = mk.tiling.plan_tiles((29, 37), (10, 12), (4, 3), (m, AxisMap.up(8)), feather)
    total = torch.zeros(plan.out_shape)
    for idx, grid, ins, outs in plan.tiles():
        w = plan.weights(idx)
        assert tuple(w.shape) == tuple(s.stop - s.start for s in outs)
        total[outs] += w
    assert torch.allclose(total, torch.ones_like(total), atol=1e-6)
    if feather < 1:  # next to an interior tile border the weight is 0: those pixels saw zero padding
        w = plan.axes[1].weights(1)
        assert w[0] == 0 and w[-1] == 0


def _upsampler():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(4, 6, 1), nn.Upsample(scale_factor=8, mode="nearest"), nn.Conv2d(6, 3, 1)).eval()


def test_run_tiled_is_exact_for_a_pointwise_decoder(mk):
    """A decoder without spatial context has no tile error: placement and blending are exact."""
    net = _upsampler()
    z = torch.randn(2, 4, 21, 30)
    plan = mk.tv.make_plan(mk.tv.VAEShape(4, 8), "decode", (21, 30), 64, 16)
    assert plan.num_tiles > 4
    with torch.inference_mode():
        steps = []
        out = mk.tv.run_tiled(z, net, plan, on_step=lambda: steps.append(1))
        ref = net(z)
    assert out.shape == ref.shape and torch.allclose(out, ref, atol=1e-5)
    assert len(steps) == mk.tv.steps_for(plan, 2, False)


def test_run_tiled_one_tile_is_bit_exact(mk):
    net = _upsampler()
    z = torch.randn(1, 4, 9, 11)
    plan = mk.tv.make_plan(mk.tv.VAEShape(4, 8), "decode", (9, 11), 512, 64)
    with torch.inference_mode():
        assert plan.num_tiles == 1 and torch.equal(mk.tv.run_tiled(z, net, plan), net(z))


def test_causal_time_tiles_place_frames_like_the_vae(mk):
    """Temporal tiles (non-cached video VAE): l latent frames → 4(l-1)+1 frames, a frame-local
    decoder gives the untiled result."""
    def dec(z):  # frame t of the output repeats latent frame ceil(t/4)
        idx = torch.tensor([0] + [1 + (t - 1) // 4 for t in range(1, 4 * (z.shape[2] - 1) + 1)])
        return z[:, :3].index_select(2, idx).repeat_interleave(8, -1).repeat_interleave(8, -2)
    z = torch.randn(1, 4, 11, 5, 6)
    shape = mk.tv.VAEShape(4, 8, 4, causal_time=True, time_cache=False)
    plan = mk.tv.make_plan(shape, "decode", (11, 5, 6), 512, 0, temporal_size=17, temporal_overlap=8)
    assert len(plan.axes[0].starts) > 1
    assert torch.allclose(mk.tv.run_tiled(z, dec, plan), dec(z), atol=1e-6)


class _GNNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.a = nn.Conv2d(4, 32, 3, padding=1)
        self.n1 = nn.GroupNorm(8, 32)
        self.b = nn.Conv2d(32, 32, 3, padding=1)
        self.n2 = nn.GroupNorm(8, 32)
        self.c = nn.Conv2d(32, 3, 1)

    def forward(self, x):
        return self.c(torch.relu(self.n2(self.b(torch.relu(self.n1(self.a(x)))))))


def test_shared_norm_stats_replay_equals_plain_forward_and_leaves_no_hook(mk):
    net = _GNNet().eval()
    x = torch.randn(1, 4, 16, 16)
    st = mk.ns.SharedGroupNormStats(net)
    with torch.inference_mode():
        with st.recording():
            ref = net(x)
        with st.replaying():
            again = net(x)
        with pytest.raises(RuntimeError, match="ran 2 times"), st.replaying():
            net(x), net(x)  # second forward without begin_forward: more calls than recorded
    assert torch.allclose(again, ref, atol=1e-5)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in net.modules())


def test_shared_norm_stats_remove_the_colour_shift_of_tiles(mk):
    """Image with a bright left half: per-tile GroupNorm statistics shift each tile."""
    net = _GNNet().eval()
    x = torch.randn(1, 4, 32, 48)
    x[..., :24] += 3.0
    plan = mk.tv.make_plan(mk.tv.VAEShape(4, 1), "decode", (32, 48), 16, 8)
    with torch.inference_mode():
        ref = net(x)
        plain = mk.tv.run_tiled(x, net, plan)
        shared = mk.tv.run_tiled(x, net, plan, norm_stats=mk.ns.SharedGroupNormStats(net))
    e_plain, e_shared = ((plain - ref).norm() / ref.norm()).item(), ((shared - ref).norm() / ref.norm()).item()
    assert e_shared < e_plain / 2, (e_shared, e_plain)


class _Mix(nn.Module):
    """Global context: adds the spatial mean (what attention with uniform weights does)."""

    def forward(self, x):
        return x + x.mean(dim=(-2, -1), keepdim=True)


def test_global_head_and_tail_make_a_global_op_exact(mk):
    torch.manual_seed(2)
    mix = _Mix()
    dec = nn.Sequential(nn.Conv2d(4, 8, 1), mix, nn.Upsample(scale_factor=8), nn.Conv2d(8, 3, 1)).eval()
    enc = nn.Sequential(nn.Conv2d(3, 8, 1), nn.AvgPool2d(8), mix, nn.Conv2d(8, 4, 1)).eval()
    z = torch.randn(1, 4, 20, 26)
    px = torch.rand(1, 3, 160, 208)
    with torch.inference_mode():
        plan = mk.tv.make_plan(mk.tv.VAEShape(4, 8), "decode", (20, 26), 64, 16)
        plain = mk.tv.run_tiled(z, dec, plan)
        headed = mk.tv.run_tiled(z, dec, plan, head_module=mix)
        ref = dec(z)
        assert not torch.allclose(plain, ref, atol=1e-3)
        assert torch.allclose(headed, ref, atol=1e-5)
        plan = mk.tv.make_plan(mk.tv.VAEShape(4, 8), "encode", (160, 208), 64, 16)
        tailed = mk.tv.run_tiled(px, enc, plan, tail_module=mix, tail_dummy=lambda x: x[..., :8, :8])
        assert torch.allclose(tailed, enc(px), atol=1e-5)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in list(dec.modules()) + list(enc.modules()))


class _FrameMix(nn.Module):
    """Global over each frame's pixels, local in time: ``[B, C, T, h, w]``."""

    def forward(self, x):
        return x + x.mean(dim=(-2, -1), keepdim=True)


class _ChunkedByFrameSize(nn.Module):
    """Runs ``body`` in time chunks whose length follows the bytes of one frame, as 0.33's
    LTX-Video encoder does (``chunk_t`` from ``get_max_chunk_size`` / frame bytes): frames of more
    than ``limit`` elements in chunks of 2, smaller ones whole."""

    def __init__(self, body: nn.Module, limit: int):
        super().__init__()
        self.body, self.limit = body, limit

    def forward(self, x):
        step = 2 if x[:, :, :1].numel() > self.limit else x.shape[2]
        return torch.cat([self.body(c) for c in torch.split(x, step, dim=2)], 2)


def test_global_tail_lines_up_time_chunks_that_differ_between_tiles_and_final_pass(mk):
    """A video encoder that chunks time by the frame size runs the tail module 3 times per tile
    (chunks of 2 of 5 frames) and once on the final pass's small input: the final pass gets the
    tiles' map frame range by frame range, and the result is exact for a global op (call by call,
    the final pass got the first chunk's 2 frames for all 5: a tile of the wrong size). A final
    pass that uses fewer frames than the tiles gave raises GlobalContextMismatch."""
    torch.manual_seed(4)
    mix = _FrameMix()
    body = nn.Sequential(nn.Conv3d(3, 8, 1), nn.AvgPool3d((1, 8, 8)), mix, nn.Conv3d(8, 4, 1)).eval()
    enc = _ChunkedByFrameSize(body, limit=3 * 16 * 16)
    px = torch.rand(1, 3, 5, 160, 208)
    with torch.inference_mode():
        plan = mk.tv.make_plan(mk.tv.VAEShape(4, 8, 1, False, True), "encode", (5, 160, 208), 64, 16)
        plain = mk.tv.run_tiled(px, enc, plan)
        tailed = mk.tv.run_tiled(px, enc, plan, tail_module=mix, tail_dummy=lambda x: x[..., :8, :8])
        ref = enc(px)
        assert not torch.allclose(plain, ref, atol=1e-3)
        assert tailed.shape == ref.shape and torch.allclose(tailed, ref, atol=1e-5)
        tail = mk.gc.GlobalTail(mix, (20, 26))
        tail.maps = [torch.zeros(1, 8, 2, 20, 26), torch.zeros(1, 8, 3, 20, 26)]
        with pytest.raises(mk.gc.GlobalContextMismatch, match="used 4 of 5 frames"):
            with tail.finishing():
                body(px[:, :, :4, :8, :8])
        with pytest.raises(mk.gc.GlobalContextMismatch, match="asked for 6"):
            with tail.finishing():
                body(torch.rand(1, 3, 6, 8, 8))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in body.modules())


class _SizedTail(nn.Module):
    """Stands for layers that cannot run on a stand-in input (LTX-Video's decoder writes into an
    output buffer sized from its input): refuses an input of another size than the model's."""

    def __init__(self):
        super().__init__()
        self.expect = None

    def forward(self, x):
        if self.expect is not None and tuple(x.shape[-2:]) != self.expect:
            raise RuntimeError("sized tail got a stand-in")
        return x


def test_a_stop_head_ends_the_capture_and_tiles_use_their_own_input(mk):
    """``head_stop``: the capture run ends at the head (nothing after it runs on a 1×1 stand-in),
    tiles run the head's layers on their own input; result exact for a global op; no hook left."""
    torch.manual_seed(3)
    mix, sized = _Mix(), _SizedTail()
    dec = nn.Sequential(nn.Conv2d(4, 8, 1), mix, sized, nn.Upsample(scale_factor=8), nn.Conv2d(8, 3, 1)).eval()
    z = torch.randn(1, 4, 20, 26)

    class Guard(nn.Module):  # the model's input size fixes the size the tail accepts
        def forward(self, x):
            sized.expect = tuple(x.shape[-2:])
            return dec(x)
    with torch.inference_mode():
        plan = mk.tv.make_plan(mk.tv.VAEShape(4, 8), "decode", (20, 26), 64, 16)
        with pytest.raises(RuntimeError, match="stand-in"):
            mk.tv.run_tiled(z, Guard(), plan, head_module=mix)
        out = mk.tv.run_tiled(z, Guard(), plan, head_module=mix, head_stop=True)
        assert torch.allclose(out, Guard()(z), atol=1e-5)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in dec.modules())


def test_interrupt_mid_run_leaves_no_hook(mk):
    net = _GNNet().eval()
    plan = mk.tv.make_plan(mk.tv.VAEShape(4, 1), "decode", (32, 32), 16, 4)
    calls = []

    def stop():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("stop")
    with torch.inference_mode(), pytest.raises(KeyboardInterrupt):
        mk.tv.run_tiled(torch.randn(1, 4, 32, 32), net, plan, norm_stats=mk.ns.SharedGroupNormStats(net),
                        head_module=net.n2, on_step=stop)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in net.modules())


def test_downsample_for_stats_keeps_channel_statistics(mk):
    x = torch.randn(1, 4, 40, 52) * torch.tensor([1.0, 2.0, 0.5, 3.0]).view(1, 4, 1, 1) + 1.5
    small = mk.ns.downsample_for_stats(x, (13, 17))
    assert small.shape == (1, 4, 13, 17)
    assert torch.allclose(small.mean(dim=(0, 2, 3)), x.mean(dim=(0, 2, 3)), atol=0.05)
    assert torch.allclose(small.std(dim=(0, 2, 3)), x.std(dim=(0, 2, 3)), rtol=0.1)


def test_fit_tile_picks_the_largest_tile_within_the_budget(mk):
    cost = mk.tv.TileCost(fixed_bytes=1000, per_unit_bytes=10, source="modelled")
    t = mk.tv.fit_tile((100, 80), cost, budget_bytes=1000 + 10 * 30 * 30, max_tile=64)
    assert t == 30
    assert mk.tv.fit_tile((10, 8), cost, budget_bytes=1000 + 10 * 80, max_tile=64) == 64  # whole image fits
    assert mk.tv.fit_tile((100, 80), cost, budget_bytes=1500, max_tile=64, min_tile=8) is None


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_measured_tile_cost_grows_with_the_tile(mk, device):
    """Measured on any device (CPU: live tensor bytes), not only on CUDA."""
    net = _upsampler().to(device)
    with torch.inference_mode():
        cost = mk.tv.measure_tile_cost(net, lambda t: torch.randn(1, 4, t, t, device=device), torch.device(device))
    # output alone: 3 channels × 64 pixels per latent pixel × 4 bytes
    assert cost.source == "measured" and cost.per_unit_bytes >= 3 * 64 * 4
    assert cost.bytes_for(64 * 64) > cost.bytes_for(32 * 32)


def test_replayed_group_norms_cost_no_more_memory_than_the_plain_forward(mk):
    """The replay hooks write into each GroupNorm's own output: the real tiles (which run
    under them) peak no higher than the plain forward the tile cost is measured on. Out of
    place, every norm kept one extra activation alive."""
    from comfyui_memorykit.memorykit.peak_memory import peak_bytes
    net = _GNNet().eval()
    x = torch.randn(1, 4, 64, 64)
    st = mk.ns.SharedGroupNormStats(net)
    with torch.inference_mode():
        plain = peak_bytes(lambda: net(x), "cpu")
        with st.recording():
            ref = net(x)
        with st.replaying():
            replayed = peak_bytes(lambda: net(x), "cpu")
        with st.replaying():
            again = net(x)
    activation = 32 * 64 * 64 * 4
    assert plain > activation  # the meter saw the activations
    # what the replay may add: per-channel scale and shift vectors (bytes), no activation
    assert replayed - plain < activation / 64, f"replay peaks at {replayed} bytes, the plain forward at {plain}"
    assert torch.allclose(again, ref, atol=1e-5)


def test_statistics_of_half_precision_are_computed_in_float32(mk):
    x = (torch.randn(2, 24, 9, 7) * 3 + 1000).to(torch.bfloat16)
    var, mean = mk.ns._var_mean_f32(x, dim=[0, 2, 3])
    ref_var, ref_mean = torch.var_mean(x.float(), dim=[0, 2, 3], correction=0, keepdim=True)
    assert var.dtype == torch.float32 and torch.allclose(mean, ref_mean) and torch.allclose(var, ref_var, rtol=1e-4)


class _CausalConv(nn.Module):
    """Causal time conv: front padding of ``kernel_t − 1`` frames (zeros or replicate)."""

    def __init__(self, ch: int, kt: int, mode: str):
        super().__init__()
        self.kt, self.mode = kt, mode
        self.conv = nn.Conv3d(ch, ch, (kt, 3, 3), padding=(0, 1, 1))

    def forward(self, x):
        return self.conv(nn.functional.pad(x, (0, 0, 0, 0, self.kt - 1, 0), mode=self.mode))


class _DepthToTime(nn.Module):
    """×k time upsampler that keeps only the last of the first frame's k (Mochi's DepthToSpaceTime)."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def forward(self, x):
        b, c, t, h, w = x.shape
        y = x.reshape(b, c // self.k, self.k, t, h, w).permute(0, 1, 3, 2, 4, 5).reshape(b, c // self.k, t * self.k, h, w)
        return y[:, :, self.k - 1:]


@pytest.mark.parametrize("mode", ["constant", "replicate"])
def test_time_carry_chunks_equal_the_whole_forward(comfy, mode):
    """A causal decoder (time convs with zero or replicate padding, a ×2 depth-to-time upsampler,
    pointwise layers) run in chunks of 1, 2 and 3 frames with the carried cache equals the whole
    forward; chunks without it do not; no hook is left."""
    from comfyui_memorykit.memorykit.time_carry import Link, TimeCarry
    torch.manual_seed(0)
    a, b, up = _CausalConv(8, 3, mode), _CausalConv(4, 2, mode), _DepthToTime(2)
    net = nn.Sequential(a, nn.SiLU(), up, b, nn.Conv3d(4, 3, 1)).eval()
    links = [Link(a, 2), Link(up, 1, 2, 1), Link(b, 1)]
    x = torch.randn(1, 8, 7, 5, 6)
    with torch.no_grad():
        ref = net(x)
        for chunk in (1, 2, 3):
            out = TimeCarry(links).run(net, x, chunk)
            assert out.shape == ref.shape and torch.allclose(out, ref, atol=1e-5), chunk
        plain = torch.cat([net(x[:, :, :3]), net(x[:, :, 3:])], 2)
        assert plain.shape != ref.shape or not torch.allclose(plain, ref, atol=1e-3)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in net.modules())
