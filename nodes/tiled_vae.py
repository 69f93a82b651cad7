"""Tiled VAE Decode / Tiled VAE Encode nodes: schema + one call into memorykit."""
from __future__ import annotations

from comfy_api.latest import io

from ..memorykit import badge, comfy_integration, memory, report, tiled_vae, validation


def _tiling_inputs() -> list:
    return [
        io.Int.Input("tile_size", default=512, min=32, max=8192, step=8,
                     tooltip="Largest tile edge in pixels (one tile of this size is what sits in memory at a time). "
                             "Tiles are spread evenly over the image; an image no larger than one tile is "
                             "processed whole, exactly as VAE Decode/Encode would. A VAE from Memory Plan caps it "
                             "at the planned tile (unless memory_budget_gb is set)."),
        io.Int.Input("overlap", default=64, min=0, max=8192, step=8,
                     tooltip="Pixels shared by neighbouring tiles; must be smaller than tile_size. Image VAEs, "
                             "Wan, and HunyuanVideo, HunyuanVideo 1.5 and LTX with time uncut: the seam sits in the "
                             "middle of the overlap, cross-faded over a quarter of it, the rest is context that hides "
                             "the borders; Mochi, Cosmos and video cut into temporal tiles cross-fade over the whole "
                             "overlap. Larger = fewer visible seams, more work."),
        io.Int.Input("temporal_size", default=64, min=1, max=4096, step=1,
                     tooltip="Video VAEs only: frames per temporal tile (not used, nor checked, for image VAEs). "
                             "Ignored where the VAE itself runs time in causal "
                             "chunks with a carried cache (Wan 2.1/2.2, HunyuanVideo 1.5; HunyuanVideo and LTX on "
                             "ComfyUI 0.33+): time is never cut and stays exact. Mochi decode, and HunyuanVideo on "
                             "ComfyUI 0.3.75: time is never cut either, each tile runs chunks of this many frames "
                             "with the cache carried by this node (HunyuanVideo: with the global context and "
                             "statistics taken on the whole length; without global_context it cuts time)."),
        io.Int.Input("temporal_overlap", default=8, min=0, max=4096, step=1,
                     tooltip="Video VAEs only: frames shared by neighbouring temporal tiles (smaller than "
                             "temporal_size). Ignored where time is never cut (see temporal_size)."),
        io.Float.Input("memory_budget_gb", default=0.0, min=0.0, max=4096.0, step=0.25,
                       tooltip="Memory (GiB) this node may use on the VAE's device: VAE weights + one tile. The "
                               "largest tile up to tile_size that fits is chosen, from a measured cost on CUDA "
                               "(two probe tiles) or ComfyUI's per-VAE estimate elsewhere. 0 = the free memory."),
        io.Boolean.Input("shared_norm_stats", default=True,
                         tooltip="Give every tile the whole image's GroupNorm statistics (estimated by one "
                                 "downsampled pass) instead of its own, which removes per-tile colour shifts. "
                                 "Image VAEs, Wan and HunyuanVideo with time uncut only: HunyuanVideo 1.5, LTX, Mochi "
                                 "and Cosmos keep each tile's own (shared ones measured worse there)."),
        io.Boolean.Input("global_context", default=True,
                         tooltip="Run the VAE's low-resolution middle part (with its global attention) once on the "
                                 "whole latent and give each tile its crop (SD-family, Flux, Flux 2, Qwen-Image, "
                                 "Wan 2.1/2.2, HunyuanVideo 1.5, Mochi decode; HunyuanVideo and LTX "
                                 "with time uncut). Much closer "
                                 "to the untiled result; costs memory proportional to the whole latent. Off: one "
                                 "pass of plain tiles, for comparison — at the same tiles farther from untiled than "
                                 "ComfyUI's VAE Decode (Tiled), which averages three tilings (measured: SD decode "
                                 "1.6×, HunyuanVideo 1.4× core's error)."),
    ]


def _options(kw: dict) -> comfy_integration.TiledVAEOptions:
    kw = dict(kw, memory_budget_gb=validation.finite_number(kw["memory_budget_gb"], "memory_budget_gb", 0.0, 4096.0))
    return comfy_integration.TiledVAEOptions(
        tile_px=kw["tile_size"], overlap_px=kw["overlap"], temporal_size=kw["temporal_size"],
        temporal_overlap=kw["temporal_overlap"], memory_budget_gb=kw["memory_budget_gb"],
        shared_norm_stats=kw["shared_norm_stats"], global_context=kw["global_context"])


def _with_report(label: str, call):
    memory.reset_cuda_peak()
    memory.reset_host_peak()
    result, info = call()
    rep = report.build_report(label, comfy_integration.loaded_models())
    rep["tiled_vae"] = info
    return result, {"memorykit_report": [badge.with_badge(rep)], "text": [report.format_report(rep) + "\n" + tiled_vae.format_info(info)]}


class TiledVAEDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="MemoryKitTiledVAEDecode",
            display_name="Tiled VAE Decode",
            category="MemoryKit",
            description=(
                "Decodes latents to images in overlapping tiles so a large image or a long video fits in "
                "memory: one pass (each tile decoded once), seams cross-faded, GroupNorm statistics shared "
                "across tiles and the VAE's middle block run on the whole latent where the VAE allows "
                "(see the inputs), one image of a batch at a time. Reports the tile plan and peak memory (resets the peak counters at its start)."),
            inputs=[io.Latent.Input("samples", tooltip="Latents to decode (image or video)."),
                    io.Vae.Input("vae", tooltip="The VAE of the model that produced the latents.")] + _tiling_inputs(),
            outputs=[io.Image.Output(tooltip="Decoded images (video frames are concatenated, as VAE Decode does).")],
        )

    @classmethod
    def execute(cls, samples, vae, **kw) -> io.NodeOutput:
        opts = _options(kw)
        validation.nonempty_batch(samples["samples"].shape, "samples", "LATENT")
        images, ui = _with_report("Tiled VAE Decode", lambda: comfy_integration.tiled_vae_decode(
            vae, samples["samples"], opts))
        return io.NodeOutput(images, ui=ui)


class TiledVAEEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="MemoryKitTiledVAEEncode",
            display_name="Tiled VAE Encode",
            category="MemoryKit",
            description=(
                "Encodes images (or a video's frames) to latents in overlapping tiles: one pass, seams "
                "cross-faded, GroupNorm statistics shared across tiles and the encoder's low-resolution end "
                "run once on the whole assembled feature map where the VAE allows (see the inputs). Reports the tile plan and peak memory."),
            inputs=[io.Image.Input("pixels", tooltip="Images to encode; for a video VAE the batch is the frames."),
                    io.Vae.Input("vae", tooltip="The VAE to encode with.")] + _tiling_inputs(),
            outputs=[io.Latent.Output(tooltip="The latents.")],
        )

    @classmethod
    def execute(cls, pixels, vae, **kw) -> io.NodeOutput:
        opts = _options(kw)
        validation.nonempty_batch(pixels.shape, "pixels", "IMAGE")
        latent, ui = _with_report("Tiled VAE Encode", lambda: comfy_integration.tiled_vae_encode(
            vae, pixels, opts))
        return io.NodeOutput({"samples": latent}, ui=ui)
