"""Listen to a test server's websocket (``/ws?clientId=``) while prompts run.

ComfyUI sends progress, ``executing`` and ``executed`` messages only over the websocket of the
client that queued the prompt (the server fixture's ``client_id``). Used to interrupt a prompt
once sampling is under way and to read reports a node sends after its own execution.
"""
from __future__ import annotations

import json
import threading
import time

import websocket

from .server import ComfyServer


class WsListener:
    """Collects JSON messages in a background thread; use as a context manager."""

    def __init__(self, server: ComfyServer):
        self.messages: list[dict] = []
        self._cond = threading.Condition()
        self._ws = websocket.create_connection(f"ws://127.0.0.1:{server.port}/ws?clientId={server.client_id}",
                                               timeout=5)
        self._stop = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop:
            try:
                raw = self._ws.recv()
            except websocket.WebSocketTimeoutException:
                continue
            except Exception:  # closed
                return
            try:
                msg = json.loads(raw) if isinstance(raw, str) else None  # bytes: preview images
            except ValueError:
                msg = None
            if msg is None:
                continue
            with self._cond:
                self.messages.append(msg)
                self._cond.notify_all()

    def wait_for(self, pred, timeout: float = 120) -> dict:
        """First message (collected so far or later) for which ``pred(msg)`` is true."""
        deadline = time.time() + timeout
        with self._cond:
            while True:
                for m in self.messages:
                    if pred(m):
                        return m
                left = deadline - time.time()
                if left <= 0:
                    raise TimeoutError(f"no matching websocket message in {timeout} s; got types "
                                       f"{sorted({m.get('type') for m in self.messages})}")
                self._cond.wait(left)

    def close(self) -> None:
        self._stop = True
        try:
            self._ws.close()
        except Exception:
            pass
        self._thread.join(timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
