"""The pack loads in a real ComfyUI, every node is visible and documented."""
from __future__ import annotations

import asyncio
import json

import pytest

from harness import paths

# Every node the pack ships; a node missing from /object_info means the pack failed to load
# (ComfyUI only logs a failed import, so this list is the check).
EXPECTED_NODES = {"MemoryKitMemoryReport", "MemoryKitFreeMemory", "MemoryKitBalancedDeviceMap",
                  "MemoryKitShardedCheckpointLoader", "MemoryKitShardedTextEncoderLoader", "MemoryKitSaveSharded",
                  "MemoryKitFp8LayerwiseCast", "MemoryKitGroupOffload", "MemoryKitGroupOffloadLoader",
                  "MemoryKitTiledVAEDecode", "MemoryKitTiledVAEEncode", "MemoryKitMemoryPlan",
                  "MemoryKitTextEncoderGroupOffload", "MemoryKitTextEncoderFp8", "MemoryKitTextEncoderDevice"}


def pack_node_ids(object_info: dict) -> set[str]:
    return {k for k, v in object_info.items() if v.get("python_module", "").endswith("ComfyUI-MemoryKit")}


def test_pack_nodes_appear_in_object_info(object_info):
    ours = pack_node_ids(object_info)
    assert EXPECTED_NODES <= ours, f"missing from /object_info: {EXPECTED_NODES - ours}"


def test_every_input_has_a_tooltip_and_category(object_info):
    for node_id in pack_node_ids(object_info):
        info = object_info[node_id]
        assert info["category"].startswith("MemoryKit"), node_id
        assert info["description"], node_id
        for section in ("required", "optional"):
            for name, spec in info["input"].get(section, {}).items():
                opts = spec[1] if len(spec) > 1 else {}
                assert opts.get("tooltip"), f"{node_id}.{name} has no tooltip"


def test_server_log_shows_no_import_failure(server, object_info):
    log = server.log_tail(200_000)
    assert "ComfyUI-MemoryKit" in log
    for line in log.splitlines():
        if "ComfyUI-MemoryKit" in line:
            assert "IMPORT FAILED" not in line, line
    # What a user reads at startup (before later tests' prompts add their own errors): no traceback
    # through the pack (0.3.75 logs core's own torchaudio ones),
    # and one line saying the pack loaded, how many nodes, where they are.
    startup = server.log_path.read_text(errors="replace").split("To see the GUI")[0]
    ours = [line for line in startup.splitlines() if line.lstrip().startswith('File "') and "ComfyUI-MemoryKit" in line]
    assert not ours, "a traceback through the pack at startup:\n" + startup[-6000:]
    loaded = [line for line in startup.splitlines() if "[MemoryKit]" in line]
    assert len(loaded) == 1, loaded
    assert f"[MemoryKit] {len(pack_node_ids(object_info))} nodes loaded (category MemoryKit;" in loaded[0], loaded


def test_in_process_entrypoint_lists_the_same_nodes(comfy):
    ext = asyncio.run(comfy.comfy_entrypoint())
    nodes = asyncio.run(ext.get_node_list())
    assert {n.GET_SCHEMA().node_id for n in nodes} >= EXPECTED_NODES
    assert comfy.WEB_DIRECTORY == "./js"


def test_example_workflows_are_ui_format():
    files = sorted((paths.REPO / "example_workflows").glob("*.json"))
    assert files, "no example workflows"
    for f in files:
        ui = json.loads(f.read_text())
        assert {"nodes", "links", "version"} <= set(ui), f.name
        assert any(n["type"].startswith("MemoryKit") for n in ui["nodes"]), f"{f.name} uses no MemoryKit node"


def test_templates_name_real_model_files_with_their_download_urls():
    """A user opening a template gets real file names (not the test fixtures'), each single-file
    model with its download URL in the loader's properties.models, as core's templates do; the
    tests and the demo map them to the generated stand-ins (harness.examples.MODEL_FILES)."""
    from harness.examples import MODEL_FILES
    for f in sorted((paths.REPO / "example_workflows").glob("*.json")):
        ui = json.loads(f.read_text())
        note = " ".join(str(v) for n in ui["nodes"] if n["type"] == "Note" for v in n["widgets_values"])
        for n in ui["nodes"]:
            if not ("Loader" in n["type"] or n["type"] == "CheckpointLoaderSimple"):
                continue
            name = n["widgets_values"][0]
            assert not name.startswith("mk_"), f"{f.name}: {n['type']} names the test fixture {name}"
            urls = {m["name"]: m["url"] for m in n.get("properties", {}).get("models", [])}
            if name.endswith(".safetensors"):
                assert urls.get(name, "").startswith("https://huggingface.co/"), f"{f.name}: no URL for {name}"
            else:  # a sharded folder: the Note says how to make it
                assert "Save Sharded" in note or "sharded_loaders_sd15" in note, f"{f.name}: {name}"
            assert name in MODEL_FILES or n["type"] == "CLIPLoader", f"{f.name}: {name} has no stand-in"


@pytest.mark.parametrize("name", sorted(p.stem for p in (paths.REPO / "example_workflows").glob("*.json")))
def test_example_workflow_round_trips(name, object_info):
    from harness import workflow
    ui = json.loads((paths.REPO / "example_workflows" / f"{name}.json").read_text())
    api = workflow.strip_meta(workflow.ui_to_api(ui, object_info))
    assert workflow.strip_meta(workflow.ui_to_api(workflow.api_to_ui(api, object_info), object_info)) == api


def test_comfy_registry_validation_passes():
    """`comfy node validate` (comfy-cli) runs the Comfy Registry's publishing checks offline."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path
    comfy_cli = Path(sys.executable).with_name("comfy")
    exe = str(comfy_cli) if comfy_cli.exists() else shutil.which("comfy")
    assert exe, "comfy-cli is not installed (requirements-dev.txt)"
    proc = subprocess.run([exe, "--skip-prompt", "--no-enable-telemetry", "node", "validate"], cwd=paths.REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "passed" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def _combo_options(spec: list) -> list | None:
    """The choices of a COMBO input spec (old style: a list as the type; V3: "COMBO" + options)."""
    if isinstance(spec[0], list):
        return spec[0]
    if spec[0] == "COMBO" and len(spec) > 1 and isinstance(spec[1], dict):
        return spec[1].get("options")
    return None


def test_every_template_widget_value_is_valid_for_its_node(object_info):
    """What the Run button sends: every widget value of every template, read as the frontend maps
    ``widgets_values`` to inputs, is one the node accepts (no None for an optional widget such as
    CLIPLoader's ``device``, a COMBO value in its list, numbers within min/max). Model file names
    are the user's files (the stand-ins are mapped by the tests), so file lists are not checked."""
    from harness import workflow
    from harness.examples import MODEL_FILES
    bad = []
    for f in sorted((paths.REPO / "example_workflows").glob("*.json")):
        for n in json.loads(f.read_text())["nodes"]:
            values = n.get("widgets_values")
            if n["type"] not in object_info or not isinstance(values, list) or n.get("mode") in (2, 4):
                continue  # Notes, Reroutes, muted/bypassed nodes
            info = object_info[n["type"]]["input"]
            specs = {**info.get("required", {}), **info.get("optional", {})}
            widgets = []  # widgets_values, paired with their input names the way the frontend lays them out
            for name, _typ, opts, is_widget in workflow._input_specs(object_info[n["type"]]):
                if is_widget:
                    widgets.append(name)
                    if opts.get("control_after_generate"):
                        widgets.append(None)  # the "control after generate" value
            for name, val in zip(widgets, values):
                if name is None:
                    continue
                spec = specs[name]
                where = f"{f.name}: node {n['id']} {n['type']}.{name} = {val!r}"
                if val is None:
                    bad.append(where + " (no value: the prompt is rejected)")
                    continue
                options = _combo_options(spec)
                opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
                if options is not None:
                    is_file = val in MODEL_FILES or any(str(o).endswith((".safetensors", ".gguf", ".pt", ".ckpt", ".sft"))
                                                        for o in options) or str(val).endswith(".safetensors")
                    if val not in options and not is_file:
                        bad.append(where + f" not in {options[:12]}")
                elif spec[0] in ("INT", "FLOAT") and isinstance(val, (int, float)):
                    if ("min" in opts and val < opts["min"]) or ("max" in opts and val > opts["max"]):
                        bad.append(where + f" outside [{opts.get('min')}, {opts.get('max')}]")
    assert not bad, "template widget values the node rejects:\n" + "\n".join(bad)
