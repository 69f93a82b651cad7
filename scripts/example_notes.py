"""The Note shown beside each example workflow (template), by workflow name; used by
``build_example_workflows.py``. Each says what the workflow shows, then what to change for a real
model (the templates' sizes and steps are small so the demo and the tests run on a CPU)."""

# The templates' image/video sizes and step counts are the test fixtures'; said once per Note.
_SD15_SIZE = " For real use: 512x512 (Empty Latent Image) and 20 steps."
# Where each model file goes: ComfyUI's missing-models dialog offers the download link (the loaders'
# properties.models) but a Note read on its own must name the folder.
_SD15_REAL = _SD15_SIZE + (" The checkpoint goes in models/checkpoints; when it is missing, ComfyUI offers its "
                           "download link as you open the workflow.")
_FOLDERS = (" The files go in models/diffusion_models, models/text_encoders and models/vae; ComfyUI offers the "
            "download link of each missing one as you open the workflow.")
_VAE_REAL = (" The VAE goes in models/vae; when it is missing, ComfyUI offers its download link as you open the "
             "workflow.")
_WAN_REAL = (" For real use: 832x480 and 33-81 frames (Empty latent) and 20-30 steps." + _FOLDERS
             + " ModelSamplingSD3 (shift 8) is the sampling "
             "shift Comfy's own Wan templates use.")

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
                            "Load Checkpoint -> Save Sharded (name sd15_unet_sharded) for the UNet; for the CLIP-L "
                            "copy the text_encoder/ folder of the Hugging Face repository "
                            "stable-diffusion-v1-5/stable-diffusion-v1-5 (its model.safetensors; a folder of "
                            "shards + model.safetensors.index.json works the same) into models/text_encoders/ "
                            "and name it sd15_clip_l_sharded. For your own model pick its folder in "
                            "models/diffusion_models/ (e.g. FLUX.1-dev/transformer)."
                            + _SD15_SIZE + _VAE_REAL,
    "group_offload_wan21_t2v": "Group Offload: Wan 2.1 14B (fp8_scaled, 14.3 GB of weights) on an 8-16 GB "
                               "card. The model does not fit in VRAM, so its blocks stay in RAM and are streamed "
                               "to the GPU just in time, the next block copied while the current one computes. "
                               "The 1.3B model (2.8 GB in fp16) fits any 8 GB card whole and needs no offload. "
                               "RAM must hold the 14.3 GB plus the text encoder (6.7 GB) while it runs: with "
                               "16 GB RAM set offload_to disk (blocks read from a fast SSD instead; disk_folder "
                               "empty = user/__memorykit/offload). vram_budget_gb 0 = what ComfyUI offers. After "
                               "a run the badge shows the bytes kept on the GPU, the bytes streamed per step and "
                               "the peak." + _WAN_REAL,
    "combined_sd15": "Every technique in one graph: sharded loaders -> FP8 Layerwise Cast -> Group Offload -> "
                     "KSampler -> Tiled VAE Decode -> Memory Report. The sharded folders are made as in the "
                     "sharded_loaders_sd15 template. An SD1.5 UNet (1.7 GB in fp16, 0.9 GB in fp8) fits an 8 GB "
                     "card; the graph shows how the nodes chain, and is the same for a model that does not fit "
                     "(swap the loader's folder for Flux or Wan). Group Offload keeps the blocks in RAM "
                     "(offload_to disk when RAM is short)." + _SD15_SIZE + _VAE_REAL,
    "tiled_vae_sd15": "Tiled VAE Decode: the image decoded in overlapping 512 px tiles (64 px overlap), seams "
                      "cross-faded, using at most memory_budget_gb (2 GiB: VAE weights + one tile; the node picks "
                      "a smaller tile when one does not fit). An image up to 512x512 is one tile, decoded exactly "
                      "as VAE Decode would; the saving starts above that (a 2048x2048 decode needs about 8 GiB "
                      "untiled). Set memory_budget_gb 0 to use the free memory. The badge shows the tile grid and "
                      "the peak memory." + _SD15_REAL,
    "wan22_two_experts_on_32gb_ram": "Wan 2.2 two experts on 32 GB RAM: the high-noise and the low-noise 14B "
                                     "models (fp8_scaled, 14.3 GB each) each through Group Offload to disk: both "
                                     "experts and the text encoder (6.7 GB) are 35 GB, more than 32 GB RAM holds, so "
                                     "their blocks are read from disk (a fast SSD) as they are needed; two KSampler "
                                     "(Advanced) passes split the steps (here 2 of 4; with 20 steps end the first at "
                                     "10). With 64 GB RAM set offload_to cpu on both (faster)." + _WAN_REAL,
    "memory_plan_sd15_12gb": "Memory Plan for a 12 GB card with 32 GB RAM (plan_for = given figures, vram_gb 12, "
                             "ram_gb 32): the techniques chosen for that machine and this model (fp8, Group "
                             "Offload budget, RAM or disk, VAE tiles), applied, and why (the node's text: a table of "
                             "candidates with predicted VRAM, RAM and seconds per step). An SD1.5 UNet (1.7 GB) "
                             "stays resident there; swap in SDXL, Flux or Wan and it plans for them. To plan for the "
                             "computer ComfyUI runs on, set plan_for = this machine: the node then measures its free "
                             "VRAM, RAM and disk and ignores vram_gb / ram_gb / disk_gb. The VAE goes through it so "
                             "VAE Decode uses the planned tiles; the Empty Latent's size sets the activation "
                             "estimate." + _SD15_REAL,
    "memory_plan_wan22_16gb_vram_32gb_ram": "One Memory Plan for the whole Wan 2.2 workflow on 16 GB VRAM / 32 GB RAM "
                                            "(given figures): the text encoder (clip), the high-noise expert (model), "
                                            "the low-noise expert (model_2) and the VAE are planned together, since "
                                            "RAM holds them all while each runs in turn. The node's text gives each "
                                            "component's decision and why, and the workflow's peak VRAM, RAM and "
                                            "disk. To change: vram_gb / ram_gb / disk_gb for your machine (or "
                                            "plan_for = this machine to measure it), and the Empty latent's size "
                                            "to your video's (the plan reads it)." + _WAN_REAL,
    "memory_plan_flux2_dev_16gb_vram_64gb_ram": "One Memory Plan for the whole Flux 2 [dev] workflow on 16 GB VRAM / 64 GB "
                                                "RAM (given figures): the text encoder (Mistral Small 3 24B, 22 GiB in "
                                                "fp8), the diffusion model (31 GiB in fp8) and the VAE are planned "
                                                "together. Neither big model fits 16 GB of VRAM, but both fit 64 GB of "
                                                "RAM, so the plan keeps them in RAM and streams them to the GPU: the "
                                                "diffusion model every step, the text encoder once per prompt (with "
                                                "32 GB RAM it streams both from disk instead). The node's text gives each component's decision and why, and the "
                                                "workflow's peak VRAM, RAM and disk. To change: vram_gb / ram_gb / "
                                                "disk_gb for your machine, or plan_for = this machine (the node then "
                                                "measures this computer's free memory and ignores those three). For "
                                                "real use: 1024x1024 in both Empty Flux 2 Latent and Flux 2 Scheduler "
                                                "and 20-50 steps; the bf16 text encoder (mistral_3_small_flux2_bf16) "
                                                "works the same." + _FOLDERS,
    "tiled_vae_wan21_t2v": "Tiled VAE Decode on Wan 2.1 video: tiles in space, time kept whole (causal cache). "
                           "256 px tiles (64 px overlap) within memory_budget_gb (2 GiB; the node picks a "
                           "smaller tile when one does not fit): Wan's VAE costs far more memory per pixel than an "
                           "image VAE (it keeps a cache of past frames), so a 14B model's video leaves an 8-16 GB "
                           "card little room to decode whole. Set memory_budget_gb 0 to use the free memory. The badge shows the tile grid and the peak memory." + _WAN_REAL,
}
