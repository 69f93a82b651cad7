"""Hostile inputs through a real ComfyUI server (issue 23, "Nothing lost, round 2"): the server
keeps answering while a hostile prompt runs, the prompt ends (every wait here is bounded), and
errors name the field. In-process cases: ``test_hostile_inputs.py``."""
from __future__ import annotations

import math
import os
import re
import shutil
import time
import uuid

import pytest

from harness.server import PromptRejected
from harness.tmpfs import small_tmpfs

INDEX = "model.safetensors.index.json"
CKPT = {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "mk_sd15_tiny.safetensors"}}


def _report(ref) -> dict:
    return {"class_type": "MemoryKitMemoryReport", "inputs": {"value": ref, "label": "", "reset_peak": False}}


def _run_while_serving(server, prompt: dict, timeout: float = 120):
    """Submit ``prompt`` and, until it finishes, check that ``GET /queue`` answers within 10 s
    each time (a worker holding the GIL stops the whole server). Bounded by ``timeout``; on
    timeout the prompt is interrupted and the test fails."""
    pid = server.submit(prompt)
    t0 = time.time()
    while time.time() - t0 < timeout:
        server.get("/queue", timeout=10)  # raises when the server does not answer
        if pid in server.get(f"/history/{pid}", timeout=10):
            return server.wait(pid, timeout=10)
        time.sleep(0.2)
    server.interrupt()
    pytest.fail(f"the prompt did not finish in {timeout} s")


def _error(res) -> str:
    assert res.status == "error", f"expected an error, got {res.status}"
    return res.error["exception_message"]


# -- item 1: a backtracking regex does not stop the server ---------------------------------------

def test_item1_catastrophic_skip_pattern_keeps_the_server_answering(server):
    fp8 = {"class_type": "MemoryKitFp8LayerwiseCast",
           "inputs": {"model": ["1", 0], "storage_dtype": "float8_e4m3fn", "compute_dtype": "auto", "fp8_matmul": False,
                      "scaling": "per-tensor", "skip_preset": "auto",
                      "extra_skip_patterns": r"(\w+\.?)+Z" + f"\n# {uuid.uuid4().hex}"}}
    res = _run_while_serving(server, {"1": CKPT, "2": fp8, "3": _report(["2", 0])})
    assert res.status == "success", res.error  # a valid pattern that matches no module name
    assert server.get("/queue", timeout=10)["queue_running"] == []


def test_round3_item1_a_megabyte_of_skip_patterns_is_refused_at_once(server):
    """One pattern on 80 000 lines (1.1 MB) ran 250 s and an interrupt took 302 s to act: now
    the prompt fails at once naming the field and the limit, and the next prompt runs."""
    fp8 = {"class_type": "MemoryKitFp8LayerwiseCast",
           "inputs": {"model": ["1", 0], "storage_dtype": "float8_e4m3fn", "compute_dtype": "auto", "fp8_matmul": False,
                      "scaling": "per-tensor", "skip_preset": "auto",
                      "extra_skip_patterns": "blocks\\.0\\.zz\n" * 80_000 + f"# {uuid.uuid4().hex}"}}
    res = _run_while_serving(server, {"1": CKPT, "2": fp8, "3": _report(["2", 0])}, timeout=120)
    assert "extra_skip_patterns is 1,120,0" in _error(res) and "at most 65,536" in _error(res), _error(res)


# -- item 2: an index that is a FIFO or /dev/zero is refused without reading ---------------------

@pytest.fixture
def special_index(server):
    """``make(kind)``: a folder under models/diffusion_models whose index is a FIFO or a link to
    /dev/zero; removed afterwards (a reader blocked on the FIFO is released first)."""
    root = server.base / "models" / "diffusion_models"
    made = []

    def make(kind: str) -> str:
        name = f"mk_{kind}_{uuid.uuid4().hex[:8]}"
        (root / name).mkdir()
        made.append(root / name)
        if kind == "fifo":
            os.mkfifo(root / name / INDEX)
        else:
            (root / name / INDEX).symlink_to("/dev/zero")
        return name

    yield make
    for folder in made:
        try:  # a reader blocked in open() on the FIFO gets EOF
            os.close(os.open(folder / INDEX, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("kind,needle", [("fifo", "is a FIFO (named pipe), not a regular file"),
                                         ("zero", "is a character device, not a regular file")])
def test_item2_special_index_is_refused_and_the_server_keeps_serving(server, special_index, kind, needle):
    name = special_index(kind)
    loader = {"class_type": "MemoryKitShardedCheckpointLoader", "inputs": {"model_name": name, "weight_dtype": "default"}}
    res = _run_while_serving(server, {"1": loader, "2": _report(["1", 0])}, timeout=60)
    msg = _error(res)
    assert needle in msg and INDEX in msg, msg
    # The worker is free: the next prompt runs.
    assert server.run({"1": _report(uuid.uuid4().hex)}, timeout=60).status == "success"


# -- item 11: Save Sharded's name and destination problems, before any work ----------------------

def _save(name: str, overwrite: bool = False) -> dict:
    return {"1": CKPT, "2": {"class_type": "MemoryKitSaveSharded",
                             "inputs": {"model": ["1", 0], "name": name, "max_shard_size": "40MB",
                                        "overwrite": overwrite}}}


@pytest.fixture
def models_root(server):
    """The server's models/diffusion_models; whatever a test adds there is removed afterwards
    (the tmpfs mounts are unmounted by ``small_tmpfs`` itself)."""
    root = server.base / "models" / "diffusion_models"
    before = {p.name for p in root.iterdir()}
    yield root
    for p in root.iterdir():
        if p.name not in before:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink()


def test_item11_name_through_a_file_or_over_path_max(server, models_root):
    tag = uuid.uuid4().hex[:8]
    (models_root / f"mk_file_{tag}").write_text("user data")
    msg = _error(server.run(_save(f"mk_file_{tag}/model"), timeout=120))
    assert f"name: 'mk_file_{tag}' in the name is an existing file" in msg, msg
    msg = _error(server.run(_save("/".join(["d" * 200] * 25)), timeout=120))
    assert "name: the folder path" in msg and "give a shorter name" in msg, msg
    assert (models_root / f"mk_file_{tag}").read_text() == "user data"
    assert not (models_root / ("d" * 200)).exists()


def test_item11_read_only_folder_and_full_disk(server, models_root):
    import subprocess
    tag = uuid.uuid4().hex[:8]
    with small_tmpfs(models_root / f"mk_ro_{tag}", "4m") as ro:
        r = subprocess.run(["mount", "-o", "remount,ro", str(ro)], capture_output=True, text=True, check=False)
        if r.returncode != 0:
            pytest.skip(f"cannot remount read-only: {r.stderr.strip()}")
        msg = _error(server.run(_save(f"mk_ro_{tag}/model"), timeout=120))
        assert "name: " in msg and "read-only" in msg and ".partial-" not in msg, msg
    with small_tmpfs(models_root / f"mk_full_{tag}", "1m") as full:
        msg = _error(server.run(_save(f"mk_full_{tag}/model"), timeout=120))
        # round 3, item 8: a size in a unit that fits (it said "0.00 GiB are free")
        assert "not enough free space" in msg and re.search(r" \d+(\.\d+)? (MiB|KiB|bytes) are free", msg), msg
        assert "0.00 GiB" not in msg, msg
        assert list(full.iterdir()) == []


# -- item 12: NaN through JSON is refused naming the field ---------------------------------------

def test_item12_nan_vram_budget_is_refused_naming_the_field(server):
    go = {"class_type": "MemoryKitGroupOffload",
          "inputs": {"model": ["1", 0], "offload_type": "block_level", "num_blocks_per_group": 1,
                     "vram_budget_gb": math.nan, "use_stream": True, "record_stream": False,
                     "low_cpu_mem_usage": False, "offload_to": "cpu", "disk_folder": ""}}
    msg = _error(server.run({"1": CKPT, "2": go, "3": _report(["2", 0])}, timeout=120))
    assert "vram_budget_gb is nan, not a finite number" in msg, msg


# -- item 14: Free Memory at the end of a graph runs --------------------------------------------

def test_item14_free_memory_as_the_last_node_runs(server):
    prompt = {"1": CKPT, "2": {"class_type": "MemoryKitFreeMemory",
                               "inputs": {"value": ["1", 0], "unload_models": True, "empty_cache": True}}}
    try:
        res = server.run(prompt, timeout=120)
    except PromptRejected as e:  # before: "Prompt has no outputs"
        pytest.fail(f"Free Memory as the last node was not run: {e.body.get('error')}")
    assert res.status == "success", res.error
    rep = res.outputs["2"]["memorykit_report"][0]
    assert rep["label"] == "Free Memory" and "badge" in rep and rep["models"] == []


# -- round 4: NUL in a folder field, through JSON ------------------------------------------------

def test_round4_nul_in_a_folder_field_is_named_and_the_next_prompt_runs(server, tmp_path):
    """``"offload_folder": "...\\u0000"`` said "does not exist: create it"; now the field and the
    character are named, nothing is created, and the plain prompt after it runs."""
    dm = {"class_type": "MemoryKitBalancedDeviceMap",
          "inputs": {"model": ["1", 0], "strategy": "balanced", "max_memory": "cpu=3MiB, disk",
                     "offload_folder": f"{tmp_path}/off\x00load", "custom_device_map": ""}}
    msg = _error(server.run({"1": CKPT, "2": dm, "3": _report(["2", 0])}, timeout=120))
    assert msg.startswith("offload_folder ") and "('\\x00') cannot be part of a path: remove it" in msg, msg
    assert "Traceback" not in msg and os.listdir(tmp_path) == []
    res = server.run({"1": CKPT, "3": _report(["1", 0])}, timeout=120)
    assert res.status == "success", res.error
