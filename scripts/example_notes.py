"""The Note shown beside each example workflow (template), by workflow name; used by
``build_example_workflows.py``. Each says what the workflow shows, then what to change for a real
model (the templates' sizes and steps are small so the demo and the tests run on a CPU)."""

# The templates' image/video sizes and step counts are the test fixtures'; said once per Note.
_SD15_SIZE = " For real use: 512x512 (Empty Latent Image) and 20 steps."
_SD15_REAL = _SD15_SIZE + (" The checkpoint goes in models/checkpoints; when it is missing, ComfyUI offers its "
                           "download link as you open the workflow.")
_WAN_REAL = (" For real use: 832x480 and 33-81 frames (Empty latent) and 20-30 steps. The files go in "
             "models/diffusion_models, models/text_encoders and models/vae; ComfyUI offers the download link of "
             "each missing one as you open the workflow.")
_VAE_REAL = (" The VAE goes in models/vae; when it is missing, ComfyUI offers its download link as you open the "
             "workflow.")

NOTES = {
    "memory_report_sd15": "Memory Report: SD1.5 text-to-image with a Memory Report after sampling and after "
                          "decoding. Each shows the peak VRAM/RAM of its stage and the models ComfyUI holds; "
                          "hover its badge for the full report." + _SD15_REAL,
    "fp8_layerwise_sd15": "FP8 Layerwise Cast: the UNet stored in float8 (1 byte per weight), computed in "
                          "high precision. The badge shows the weights before -> after. Works the same after "
                          "Load Diffusion Model (Flux, Wan, SD3, ...) and before or after LoRA loaders; keep "
                          "skip_preset on auto." + _SD15_REAL,
    "memory_report_wan21_t2v": "Memory Report on Wan 2.1 text-to-video: peak memory of sampling and of the "
                               "VAE decode, and the models held." + _WAN_REAL,
    "balanced_device_map_wan21_t2v": "Balanced Device Map: Wan 2.1 split across devices. max_memory 'auto' "
                                     "fills every GPU's free memory evenly, then CPU RAM; or write budgets, "
                                     "e.g. 'cuda:0=20GiB, cuda:1=22GiB, cpu=32GiB' (add ', disk' to spill the "
                                     "rest to files; a budget too small for the model is an error naming what "
                                     "it needs). The badge shows the bytes on each device." + _WAN_REAL,
    "free_memory_sd15": "Free Memory between sampling and decoding: the Memory Report after it lists no "
                        "model. Use it so the next stage starts with free VRAM." + _SD15_REAL,
    "sharded_loaders_sd15": "Sharded loaders: the UNet and CLIP-L loaded from safetensors shards + index, one "
                            "shard at a time. The badges show shards, size and seconds. Make the folders once: "
                            "Load Checkpoint -> Save Sharded (name sd15_unet_sharded) for the UNet; a text "
                            "encoder folder is any folder of shards + model.safetensors.index.json in "
                            "models/text_encoders/ (e.g. a Hugging Face repository's text_encoder/). For your "
                            "own model pick its folder in models/diffusion_models/ (e.g. FLUX.1-dev/transformer)."
                            + _SD15_SIZE + _VAE_REAL,
    "group_offload_wan21_t2v": "Group Offload: Wan 2.1's blocks kept on disk and streamed to the GPU just "
                               "in time (offload_to cpu keeps them in RAM instead: faster when RAM holds the "
                               "model). The badge shows resident bytes, bytes streamed per forward and the "
                               "peak. vram_budget_gb 0 = what ComfyUI offers; disk_folder empty = "
                               "user/__memorykit/offload (name a fast SSD)." + _WAN_REAL,
    "combined_sd15": "Every technique in one graph: sharded loaders -> FP8 Layerwise Cast -> Group Offload -> "
                     "KSampler -> Tiled VAE Decode -> Memory Report. The sharded folders are made as in the "
                     "sharded_loaders_sd15 template. Tiled VAE's 128 px tiles suit this template's 256x256; "
                     "use 512." + _SD15_SIZE + _VAE_REAL,
    "tiled_vae_sd15": "Tiled VAE Decode: the image decoded in overlapping tiles (here 128 px with 32 px overlap: "
                      "a 3x3 grid on 256x256), seams cross-faded. The badge shows the tile grid and the peak "
                      "memory. From 512x512 up use tile_size 512 / overlap 64, or set memory_budget_gb and the "
                      "node picks the tile." + _SD15_REAL,
    "wan22_two_experts_on_32gb_ram": "Wan 2.2 two experts on 32 GB RAM: the high-noise and the low-noise 14B "
                                     "models each through Group Offload to disk, so neither has to fit in RAM or "
                                     "VRAM whole; two KSampler (Advanced) passes split the steps (here 2 of 4; "
                                     "with 20 steps end the first at 10)." + _WAN_REAL,
    "memory_plan_sd15_12gb": "Memory Plan: the techniques chosen for this machine and this model (fp8, Group "
                             "Offload budget, RAM or disk, VAE tiles), applied, and why (the node's text: a table of "
                             "candidates with predicted VRAM, RAM and seconds per step). plan_for = this machine "
                             "measures yours; set given figures to plan for a 12 GB card (vram_gb 12, ram_gb 32), "
                             "where an SD1.5 UNet stays resident. Swap in SDXL or Flux and it plans for them. The "
                             "VAE goes through it so VAE Decode uses the planned tiles; the Empty Latent's size "
                             "sets the activation estimate." + _SD15_REAL,
    "memory_plan_wan22_16gb_vram_32gb_ram": "One Memory Plan for the whole Wan 2.2 workflow on 16 GB VRAM / 32 GB RAM "
                                            "(given figures): the text encoder (clip), the high-noise expert (model), "
                                            "the low-noise expert (model_2) and the VAE are planned together, since "
                                            "RAM holds them all while each runs in turn. The node's text gives each "
                                            "component's decision and why, and the workflow's peak VRAM, RAM and "
                                            "disk. To change: vram_gb / ram_gb / disk_gb for your machine (or "
                                            "plan_for = this machine to measure it), and the Empty latent's size "
                                            "to your video's (the plan reads it)." + _WAN_REAL,
    "tiled_vae_wan21_t2v": "Tiled VAE Decode on Wan 2.1 video: tiles in space, time kept whole (causal cache). "
                           "The badge shows the tile grid and the peak memory. The 64 px tiles suit this template's "
                           "128x128; for 832x480 use tile_size 256-512 / overlap 64, or set memory_budget_gb."
                           + _WAN_REAL,
}
