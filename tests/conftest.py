"End-to-end fixtures: a real `llm-engine serve` process on a free loopback port."
import os, socket, subprocess, sys, time
import httpx, pytest

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]

class Server:
    def __init__(self, *args, env=None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "llm_engine.cli", "serve", "--port", str(self.port), "--log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
        deadline = time.time() + 240
        while time.time() < deadline:
            if self.proc.poll() is not None: raise RuntimeError(f"server exited: {self.proc.stdout.read()}")
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200: return
            except httpx.HTTPError: time.sleep(0.3)
        self.stop(); raise RuntimeError("server did not become healthy in time")
    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try: self.proc.wait(30)
            except subprocess.TimeoutExpired: self.proc.kill(); self.proc.wait()
        return self.proc.returncode

@pytest.fixture(scope="session")
def server():
    s = Server("--num-blocks", "1024", "--max-num-seqs", "32")
    yield s
    s.stop()
