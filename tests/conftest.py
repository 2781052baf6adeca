"End-to-end fixtures: a real `llm-engine serve` process on a free loopback port."
import sys
import pytest
from llm_engine.testing import ServerProcess

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
