"""server.py in a process of its own, for the tests and the benchmarks."""

import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """server.py (or `code` run as a script, given server.py's options) on a
    free port of 127.0.0.1, started and waited for until /health answers.
    Its output is kept in a temporary file (`output`)."""

    def __init__(self, *options: str, code: str | None = None, wait_seconds: float = 180):
        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+")
        argv = [*options, "--port", str(self.port)]
        command = [sys.executable, "server.py", *argv] if code is None else [sys.executable, "-c", code, *argv]
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + wait_seconds
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server.py exited ({self.process.returncode}) before it answered: {self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server.py did not answer in {wait_seconds:.0f} s: {self.output()}")

    def metrics(self, headers: dict | None = None) -> dict[str, float]:
        """GET /metrics, read by prometheus_client's own parser: each sample's
        value by its name, with its labels but model_name in braces
        ('vllm:request_success_total{finished_reason="stop"}')."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        response = httpx.get(self.url + "/metrics", headers=headers)
        response.raise_for_status()
        values = {}
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "model_name")
                values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
        return values

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self, timeout: float = 120) -> int:
        """SIGTERM, then its exit code once it has drained and stopped."""
        if self.process.poll() is None:
            self.process.terminate()
        return self.process.wait(timeout=timeout)
