"""Broken workflows are reported clearly, and the server serves the next prompt."""
from __future__ import annotations

import copy

import pytest

from harness import examples
from harness.server import PromptRejected


@pytest.fixture()
def sd15_prompt(object_info, fixture_models):
    return examples.load_example("memory_report_sd15", object_info)


def _node(prompt, class_type):
    return next(nid for nid, n in prompt.items() if n["class_type"] == class_type)


def _next_prompt_works(server, prompt):
    res = server.run(prompt)
    assert res.status == "success", res.error


def test_missing_required_input_is_rejected(server, sd15_prompt):
    bad = copy.deepcopy(sd15_prompt)
    report = _node(bad, "MemoryKitMemoryReport")
    del bad[report]["inputs"]["value"]
    with pytest.raises(PromptRejected) as e:
        server.submit(bad)
    errs = e.value.body["node_errors"][report]["errors"]
    assert any(err["type"] == "required_input_missing" and "value" in err["details"] for err in errs)
    _next_prompt_works(server, sd15_prompt)


def test_value_outside_list_is_rejected(server, sd15_prompt):
    bad = copy.deepcopy(sd15_prompt)
    loader = _node(bad, "CheckpointLoaderSimple")
    bad[loader]["inputs"]["ckpt_name"] = "no_such_model.safetensors"
    with pytest.raises(PromptRejected) as e:
        server.submit(bad)
    errs = e.value.body["node_errors"][loader]["errors"]
    assert any(err["type"] == "value_not_in_list" for err in errs)
    _next_prompt_works(server, sd15_prompt)


def test_missing_model_file_is_an_execution_error(server, sd15_prompt, tmp_path):
    # A model file that vanished after ComfyUI listed it: a dangling link in checkpoints/.
    ckpt_dir = server.base / "models" / "checkpoints"
    link = ckpt_dir / "mk_vanished.safetensors"
    link.symlink_to(tmp_path / "moved_away.safetensors")
    try:
        bad = copy.deepcopy(sd15_prompt)
        bad[_node(bad, "CheckpointLoaderSimple")]["inputs"]["ckpt_name"] = link.name
        res = server.run(bad)
        assert res.status == "error"
        assert res.error is not None and res.error["node_type"] == "CheckpointLoaderSimple"
        assert "mk_vanished" in res.error["exception_message"] or "No such file" in res.error["exception_message"]
    finally:
        link.unlink()
    _next_prompt_works(server, sd15_prompt)
