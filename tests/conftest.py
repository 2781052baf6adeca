"End-to-end fixtures: a real `llm-engine serve` process on a free loopback port."
import os, shutil, sys, tempfile
import pytest
from llm_engine.testing import ServerProcess

def pytest_configure(config):
    # Everything the tests write to temporary files (tiny models, converted GGUFs, servers' logs, pytest's own
    # tmp_path) goes in one folder, removed when the run ends: helpers that mkdtemp and never clean up had left
    # 60 GB in /tmp, and CI's disk filled (ENOSPC). Subprocesses inherit TMPDIR.
    config._llm_engine_tmp = tempfile.mkdtemp(prefix="llm_engine_pytest_")
    os.environ["TMPDIR"] = tempfile.tempdir = config._llm_engine_tmp

def pytest_unconfigure(config):
    shutil.rmtree(getattr(config, "_llm_engine_tmp", ""), ignore_errors=True)

class Server(ServerProcess):
    "`llm-engine serve ARGS`, its output kept for the tests to read; `stop()` sends SIGTERM and returns the exit code."
    def __init__(self, *args):
        # fp32, the exact path: tests compare streamed, batched and sequential outputs token for token (a later --dtype wins)
        super().__init__([sys.executable, "-m", "llm_engine.cli", "serve", "--port", "{port}", "--log-level", "warning",
                          "--dtype", "float32", *args],
                         timeout=240, capture_output=True)
    stop = ServerProcess.close

@pytest.fixture(scope="session")
def server():
    s = Server("--num-blocks", "1024", "--max-num-seqs", "32")
    yield s
    s.stop()
