"""The Note shown beside each example workflow (template), by workflow name; used by
``build_example_workflows.py``."""

NOTES = {
    "memory_report_sd15": "Memory Report: SD1.5 text-to-image with a Memory Report after sampling and after "
                          "decoding. Each shows the peak VRAM/RAM of its stage and the models ComfyUI holds.",
    "fp8_layerwise_sd15": "FP8 Layerwise Cast: the UNet stored in float8 (1 byte per weight), computed in "
                          "high precision. The badge shows the weights before -> after.",
    "memory_report_wan21_t2v": "Memory Report on Wan 2.1 text-to-video: peak memory of sampling and of the "
                               "VAE decode, and the models held.",
    "balanced_device_map_wan21_t2v": "Balanced Device Map: Wan 2.1 split across devices (here cpu + disk; on a "
                                     "multi-GPU machine e.g. 'cuda:0=20GiB, cuda:1=22GiB'). The badge shows the "
                                     "bytes on each device.",
    "free_memory_sd15": "Free Memory between sampling and decoding: the Memory Report after it lists no "
                        "model. Use it so the next stage starts with free VRAM.",
    "sharded_loaders_sd15": "Sharded loaders: the UNet and CLIP-L loaded from safetensors shards + index, one "
                            "shard at a time. The badges show shards, size and seconds. Make the folders once: "
                            "Load Checkpoint -> Save Sharded (name sd15_unet_sharded) for the UNet; a text "
                            "encoder folder is any folder of shards + model.safetensors.index.json in "
                            "models/text_encoders/ (e.g. a Hugging Face repository's text_encoder/).",
    "group_offload_wan21_t2v": "Group Offload: Wan 2.1's blocks kept on disk (or in RAM) and streamed to the "
                               "GPU just in time. The badge shows resident bytes, bytes streamed per forward "
                               "and the peak.",
    "combined_sd15": "Every technique in one graph: sharded loaders -> FP8 Layerwise Cast -> Group Offload -> "
                     "KSampler -> Tiled VAE Decode -> Memory Report. The sharded folders are made as in the "
                     "sharded_loaders_sd15 template.",
    "tiled_vae_sd15": "Tiled VAE Decode: the image decoded in overlapping tiles (here 128 px: a 3x3 grid), seams "
                      "cross-faded. The badge shows the tile grid and the peak memory.",
    "wan22_two_experts_on_32gb_ram": "Wan 2.2 two experts on 32 GB RAM: the high-noise and the low-noise 14B "
                                     "models each through Group Offload to disk, so neither has to fit in RAM or "
                                     "VRAM whole; two KSampler (Advanced) passes split the steps. Download the "
                                     "models listed in the loaders' properties.",
    "memory_plan_sd15_12gb": "Memory Plan: the techniques chosen for this machine and this model (fp8, Group "
                             "Offload budget, RAM or disk, VAE tiles), applied, and why (the node's text: a table of "
                             "candidates with predicted VRAM, RAM and seconds per step). On a 12 GB card an SD1.5 "
                             "UNet stays resident; swap in SDXL or Flux and it plans for them. The VAE goes through "
                             "it so VAE Decode uses the planned tiles.",
    "memory_plan_wan22_16gb_vram_32gb_ram": "Memory Plan for Wan 2.2's two 14B experts on 16 GB VRAM / 32 GB RAM "
                                            "(given figures): RAM holds the 6.7 GB text encoder but not both 14 GB "
                                            "experts, so each plan gets 12 GiB of RAM; at 81 frames, 832x480 each "
                                            "expert then streams from disk. Set plan_for = this machine to measure yours; use 81 frames at "
                                            "832x480 and 20 steps with the real models.",
    "tiled_vae_wan21_t2v": "Tiled VAE Decode on Wan 2.1 video: tiles in space, time kept whole (causal cache). "
                           "The badge shows the tile grid and the peak memory.",
}
