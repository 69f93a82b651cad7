"""A real ComfyUI server, started headless on a free loopback port, for tests and the demo.

The server gets its own ``--base-directory`` (a temp folder): ``custom_nodes/`` holds links
to this pack, to the test-only node folder and to city96/ComfyUI-GGUF (see ``gguf_pack``), ``models/`` links to the generated models
(and ``stand_ins/`` holds them under the example workflows' real file names, see ``stand_ins``),
``output/``/``temp/``/``user/`` are fresh. Nothing in the ComfyUI tree is written, so a
user's own checkout (``COMFYUI_PATH``) is safe.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import gguf_pack, paths, stand_ins

PACK_DIR_NAME = "ComfyUI-MemoryKit"
TEST_NODES_DIR_NAME = "memorykit_test_nodes"


class PromptRejected(Exception):
    """``POST /prompt`` answered 400; ``.body`` holds ComfyUI's ``error`` and ``node_errors``."""

    def __init__(self, body: dict):
        super().__init__(json.dumps(body)[:2000])
        self.body = body


@dataclass
class RunResult:
    """Outcome of one prompt: ``outputs`` (node id → UI output), ``status`` ('success'/'error'),
    ``error`` (the ``execution_error`` message dict or None), ``seconds`` (wall time)."""

    prompt_id: str
    outputs: dict
    status: str
    error: dict | None
    seconds: float
    messages: list = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_base_directory(base: Path, with_test_nodes: bool = True) -> Path:
    """Lay out a ComfyUI base directory in ``base`` (see module docstring); returns ``base``."""
    (base / "custom_nodes").mkdir(parents=True, exist_ok=True)
    links = [(PACK_DIR_NAME, paths.REPO)] + ([(TEST_NODES_DIR_NAME, paths.TEST_NODES)] if with_test_nodes else [])
    gguf_dir = gguf_pack.unpacked()  # city96/ComfyUI-GGUF, when its tarball is there
    if gguf_dir is not None:
        links.append((gguf_pack.DIR_NAME, gguf_dir))
    for name, target in links:
        link = base / "custom_nodes" / name
        if not link.exists():
            link.symlink_to(target, target_is_directory=True)
    models = base / "models"
    models.mkdir(exist_ok=True)
    paths.MODELS.mkdir(parents=True, exist_ok=True)
    for sub in ("checkpoints", "diffusion_models", "vae", "loras", "text_encoders", "clip"):
        (paths.MODELS / sub).mkdir(exist_ok=True)
        link = models / sub
        if not link.exists():
            link.symlink_to(paths.MODELS / sub, target_is_directory=True)
    for sub in ("output", "input", "temp", "user"):
        (base / sub).mkdir(exist_ok=True)
    stand_ins.lay_out(base)  # the templates' real model file names → the generated stand-ins
    return base


class ComfyServer:
    """Start/stop a headless ComfyUI and talk to its HTTP API.

    Usage: ``with ComfyServer() as srv: res = srv.run(api_prompt)``.
    """

    def __init__(self, base_dir: Path | None = None, extra_args: tuple[str, ...] = (),
                 with_test_nodes: bool = True, startup_timeout: float = 240.0):
        self._tmp = None
        if base_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="mk-comfy-")
            base_dir = Path(self._tmp.name)
        self.base = make_base_directory(Path(base_dir), with_test_nodes)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra_args = tuple(extra_args)
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.log_path = self.base / "server.log"
        self.client_id = uuid.uuid4().hex

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "ComfyServer":
        root = paths.comfyui_path()
        args = [sys.executable, str(root / "main.py"), "--listen", "127.0.0.1", "--port", str(self.port),
                "--base-directory", str(self.base), "--disable-auto-launch",
                "--database-url", "sqlite:///:memory:"]
        if not torch.cuda.is_available():
            args.append("--cpu")
        if (self.base / "stand_ins.yaml").is_file():
            args += ["--extra-model-paths-config", str(self.base / "stand_ins.yaml")]
        args += list(self.extra_args)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, cwd=str(root), stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env)
        deadline = time.time() + self.startup_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with code {self.proc.returncode} during start-up:\n{self.log_tail()}")
            try:
                self.get("/object_info/KSampler", timeout=5)
                return self
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"ComfyUI did not answer within {self.startup_timeout} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
        if getattr(self, "_log", None):
            self._log.close()
            self._log = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def log_tail(self, n_chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""

    # -- HTTP --------------------------------------------------------------------------------
    def get(self, route: str, timeout: float = 30):
        with urllib.request.urlopen(self.url + route, timeout=timeout) as r:
            return json.loads(r.read())

    def post(self, route: str, body: dict | None = None, timeout: float = 30) -> tuple[int, dict | None]:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(self.url + route, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
                return r.status, (json.loads(raw) if raw.strip() else None)
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw)
            except ValueError:
                return e.code, {"error": raw.decode(errors="replace")}

    def object_info(self) -> dict:
        return self.get("/object_info", timeout=120)

    # -- prompts -----------------------------------------------------------------------------
    def submit(self, prompt: dict) -> str:
        """Queue an API-format prompt; returns its id or raises :class:`PromptRejected`."""
        code, body = self.post("/prompt", {"prompt": prompt, "client_id": self.client_id})
        if code != 200:
            raise PromptRejected(body or {})
        return body["prompt_id"]

    def wait(self, prompt_id: str, timeout: float = 600) -> RunResult:
        """Poll ``/history/<id>`` until the prompt finished (or ``timeout`` s passed)."""
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI died while running a prompt:\n{self.log_tail()}")
            h = self.get(f"/history/{prompt_id}")
            if prompt_id in h:
                entry = h[prompt_id]
                st = entry.get("status", {})
                msgs = st.get("messages", [])
                err = next((m[1] for m in msgs if m[0] == "execution_error"), None)
                interrupted = any(m[0] == "execution_interrupted" for m in msgs)
                status = "interrupted" if interrupted else st.get("status_str", "?")
                return RunResult(prompt_id, entry.get("outputs", {}), status, err, time.time() - t0, msgs)
            time.sleep(0.1)
        raise TimeoutError(f"prompt {prompt_id} did not finish in {timeout} s:\n{self.log_tail()}")

    def run(self, prompt: dict, timeout: float = 600) -> RunResult:
        """Submit and wait; see :meth:`submit` and :meth:`wait`."""
        return self.wait(self.submit(prompt), timeout)

    def interrupt(self) -> None:
        self.post("/interrupt")

    def free(self, unload_models: bool = True, free_memory: bool = True, wait: bool = False) -> None:
        """``POST /free``. ComfyUI answers at once and acts later: its prompt worker reads the flags
        after the next prompt it runs, and sends nothing. ``wait=True`` queues two trivial prompts
        and waits for both: the flags were handled between them."""
        self.post("/free", {"unload_models": unload_models, "free_memory": free_memory})
        if wait:
            for _ in range(2):
                res = self.run({"1": {"class_type": "MemoryKitMemoryReport",
                                      "inputs": {"value": uuid.uuid4().hex, "label": "free", "reset_peak": False}}})
                if res.status != "success":
                    raise RuntimeError(f"trivial prompt after /free failed: {res.error}")

    def queue_remaining(self) -> int:
        return self.get("/prompt")["exec_info"]["queue_remaining"]

    # -- process figures ---------------------------------------------------------------------
    @property
    def pid(self) -> int:
        return self.proc.pid
