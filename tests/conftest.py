"End-to-end fixtures: a real `llm-engine serve` process on a free loopback port."
import sys
from contextlib import ExitStack
import pytest
from llm_engine.testing import ServerProcess, private_tmpdir

def pytest_configure(config):
    # everything the session writes to temporary files, pytest's own tmp_path included, goes in one folder that is
    # removed when the run ends (05a's private_tmpdir)
    config._llm_engine_tmp = ExitStack()
    config._llm_engine_tmp.enter_context(private_tmpdir("llm_engine_pytest_"))

def pytest_unconfigure(config):
    if hasattr(config, "_llm_engine_tmp"): config._llm_engine_tmp.close()

def linked_cache(cache, with_model=False):
    """`cache`, made, with links to the real model cache's compiled kernels (and, `with_model`, its converted default
    model): a test about a model's files need not wait on a compiler (on 2 cores, most of a fresh cache's minutes)."""
    from llm_engine.config import cache_root
    from llm_engine.model import resolve_model
    real = resolve_model(None).parent if with_model else cache_root()
    (real / "kernels").mkdir(parents=True, exist_ok=True); cache.mkdir(parents=True)
    for p in real.iterdir():
        if p.name == "kernels" or (with_model and p.is_dir() and p.name.startswith("SmolLM2")): (cache / p.name).symlink_to(p)
    return cache

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
