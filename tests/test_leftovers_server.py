"""No folder left behind by a stopped ComfyUI server (issue 14, item 4), with real servers of
their own: SIGTERM while a disk-offloaded model is loaded removes its offload folder; a kill -9
during Save Sharded leaves ``.<name>.partial-*``, which the next server start removes."""
from __future__ import annotations

import os
import shutil
import signal
import time
import uuid

import pytest

from harness.server import ComfyServer

GO = {"offload_type": "block_level", "num_blocks_per_group": 1, "vram_budget_gb": 0.0, "use_stream": True,
      "record_stream": False, "low_cpu_mem_usage": False, "offload_to": "disk"}


def _wan_offload_prompt(folder) -> dict:
    return {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": "mk_wan21_tiny.safetensors", "weight_dtype": "default"}},
            "2": {"class_type": "MemoryKitTestWanTextEncode", "inputs": {"text": "a red fox", "tokens": 16}},
            "4": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 64, "length": 5, "batch_size": 1}},
            "5": {"class_type": "MemoryKitGroupOffload", "inputs": {**GO, "disk_folder": str(folder), "model": ["1", 0]}},
            "6": {"class_type": "KSampler", "inputs": {"model": ["5", 0], "seed": 7, "steps": 1, "cfg": 1.0,
                                                      "sampler_name": "euler", "scheduler": "simple", "positive": ["2", 0],
                                                      "negative": ["2", 0], "latent_image": ["4", 0], "denoise": 1.0}},
            "7": {"class_type": "MemoryKitTestSaveTensor", "inputs": {"value": ["6", 0], "filename_prefix": "leftover"}}}


def test_sigterm_with_a_disk_offloaded_model_loaded_leaves_nothing(fixture_models, tmp_path):
    folder = tmp_path / "offload"
    folder.mkdir()
    srv = ComfyServer().start()
    try:
        res = srv.run(_wan_offload_prompt(folder))
        assert res.status == "success", res.error
        assert [n for n in os.listdir(folder) if n.startswith("memorykit-offload-")]  # loaded: files on disk
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(timeout=60)
        assert os.listdir(folder) == [], os.listdir(folder)
    finally:
        srv.stop()


def test_kill_9_during_save_sharded_is_cleaned_at_the_next_start(fixture_models, tmp_path):
    base = tmp_path / "base"
    name = f"mk_test_killed_{uuid.uuid4().hex[:8]}"
    srv = ComfyServer(base_dir=base).start()
    root = base / "models" / "diffusion_models"
    try:
        prompt = {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "mk_sd15_tiny.safetensors"}},
                  "20": {"class_type": "MemoryKitSaveSharded", "inputs": {"model": ["1", 0], "name": name,
                                                                         "max_shard_size": "1MB", "overwrite": False}}}
        srv.submit(prompt)
        deadline = time.time() + 300
        partial = []
        while time.time() < deadline and not partial:
            partial = [p for p in root.glob(f".{name}.partial-*") if any(p.glob("*.safetensors"))]
            time.sleep(0.01)
        assert partial, f"Save Sharded never started writing:\n{srv.log_tail()}"
        srv.proc.kill()
        srv.proc.wait(timeout=60)
        assert partial[0].is_dir() and not (root / name).exists()
        srv.stop()
        srv = ComfyServer(base_dir=base).start()
        assert not partial[0].exists(), "the killed server's partial folder survived a restart"
    finally:
        srv.stop()
        shutil.rmtree(root / name, ignore_errors=True)
        for left in root.glob(f".{name}.*"):
            shutil.rmtree(left, ignore_errors=True)
