"""Start-up safety of the model cache: a server killed while converting a GGUF leaves nothing behind for good, two
servers started at once on a fresh cache both come up, and a truncated or corrupt cached file is rebuilt, not served.

The GGUF here is a small random Llama (f32 tensors) carrying the default model's tokenizer, so a conversion takes
seconds; the servers use the torch attention path, and each test's cache links the real one's compiled kernels
(`linked_cache`, conftest), so nothing here waits on a compiler."""
import os, signal, subprocess, sys, tempfile, threading, time
from pathlib import Path
import httpx, pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from soak import LoggedServer
from conftest import linked_cache

def make_tiny_gguf(out, hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, ctx=2048, seed=0) -> Path:
    "A random Llama GGUF with the embedded model's tokenizer and chat template (made once; about 55 MB)."
    import gguf, numpy as np
    from llm_engine.model import default_gguf_path
    out = Path(out)
    if out.exists(): return out
    src = gguf.GGUFReader(default_gguf_path())
    part = out.with_name(out.name + f".part{os.getpid()}")
    w = gguf.GGUFWriter(str(part), "llama")
    hp = {"llama.block_count": layers, "llama.context_length": ctx, "llama.embedding_length": hidden,
          "llama.feed_forward_length": ffn, "llama.attention.head_count": heads, "llama.attention.head_count_kv": kv_heads,
          "llama.rope.dimension_count": hidden // heads}
    for k, f in src.fields.items():
        if k.startswith("GGUF.") or k in hp or k in ("general.architecture", "general.file_type", "general.quantization_version"): continue
        if f.types[0] == gguf.GGUFValueType.ARRAY: w.add_array(k, f.contents())
        else: w.add_key_value(k, f.contents(), f.types[0])
    for k, v in hp.items(): w.add_uint32(k, v)
    V, hd, rng = int(src.fields["llama.vocab_size"].contents()), hidden // heads, np.random.default_rng(seed)
    r = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float32)
    w.add_tensor("token_embd.weight", r(V, hidden))
    for i in range(layers):
        for name, t in [("attn_norm", np.ones(hidden, np.float32)), ("attn_q", r(heads * hd, hidden)), ("attn_k", r(kv_heads * hd, hidden)),
                        ("attn_v", r(kv_heads * hd, hidden)), ("attn_output", r(hidden, heads * hd)),
                        ("ffn_norm", np.ones(hidden, np.float32)), ("ffn_gate", r(ffn, hidden)), ("ffn_up", r(ffn, hidden)),
                        ("ffn_down", r(hidden, ffn))]:
            w.add_tensor(f"blk.{i}.{name}.weight", t)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    os.replace(part, out)
    return out

@pytest.fixture(scope="module")
def tiny_gguf():
    d = Path(tempfile.gettempdir()) / "llm_engine_tiny_gguf"; d.mkdir(exist_ok=True)
    return make_tiny_gguf(d / "tiny-random-llama.gguf")

def temp_folders(cache: Path) -> list[Path]: return [p for p in cache.glob("*.tmp*")]
def model_folders(cache: Path) -> list[Path]: return [p for p in cache.iterdir() if p.is_dir() and ".tmp" not in p.name and p.name != "kernels"]

SERVE = ["--num-blocks", "64", "--max-model-len", "256", "--attention-backend", "torch", "--log-level", "warning"]

def kill_during_conversion(gguf: Path, cache: Path, tries=4) -> Path:
    "Start a server on an empty cache and SIGKILL it while it writes its temporary folder; returns that folder."
    for _ in range(tries):
        p = subprocess.Popen([sys.executable, "-m", "llm_engine.cli", "serve", "--model", str(gguf), "--port", "1", *SERVE],
                             env={**os.environ, "LLM_ENGINE_CACHE": str(cache)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 180
        while time.time() < deadline and p.poll() is None:
            if cache.exists() and temp_folders(cache): break
            time.sleep(0.002)
        p.send_signal(signal.SIGKILL); p.wait()
        left = temp_folders(cache) if cache.exists() else []
        if left: return left[0]
        for m in model_folders(cache) if cache.exists() else []: __import__("shutil").rmtree(m)   # finished first: try again
    pytest.fail(f"could not kill the server inside its conversion in {tries} tries")

def completion(base):
    r = httpx.post(base + "/v1/completions", json={"prompt": "hello", "max_tokens": 4, "ignore_eos": True}, timeout=60)
    return r.status_code, r.json()

def test_kill_during_conversion_then_two_simultaneous_starts(tiny_gguf, tmp_path):
    cache = linked_cache(tmp_path / "cache")
    t0 = time.perf_counter()
    stale = kill_during_conversion(tiny_gguf, cache)
    assert stale.exists()                                     # the precondition: a writer died mid-conversion
    servers, errors = [None, None], []
    def start(i):
        try: servers[i] = LoggedServer("--model", tiny_gguf, *SERVE, env={"LLM_ENGINE_CACHE": cache}, timeout=300)
        except Exception as e: errors.append(e)
    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in threads: t.start()
    for t in threads: t.join()
    try:
        assert not errors, errors
        answers = [completion(s.base) for s in servers]
        assert all(code == 200 and body["usage"]["completion_tokens"] == 4 for code, body in answers), answers
        assert temp_folders(cache) == [], temp_folders(cache)  # the dead writer's folder is gone, nor did the two leave one
        assert len(model_folders(cache)) == 1
        print(f"\nstart-up: killed mid-conversion (left {stale.name}); two simultaneous starts both served; "
              f"no temporary folder left; {time.perf_counter() - t0:.0f} s")
    finally:
        for s in servers:
            if s: assert s.stop() == 0

@pytest.fixture(scope="module")
def converted(tiny_gguf, tmp_path_factory):
    "A cache holding the tiny GGUF converted once (shared by the tests below)."
    from llm_engine.model import resolve_model
    cache = linked_cache(tmp_path_factory.mktemp("converted") / "cache")
    os.environ["LLM_ENGINE_CACHE"] = str(cache)
    try: return cache, resolve_model(tiny_gguf)
    finally: del os.environ["LLM_ENGINE_CACHE"]

def test_stale_temporary_folders_are_removed_live_ones_kept(tiny_gguf, converted, monkeypatch):
    from llm_engine.model import resolve_model
    cache, out = converted
    monkeypatch.setenv("LLM_ENGINE_CACHE", str(cache))
    dead = subprocess.Popen(["true"]); dead.wait()                 # a pid that is surely gone
    stale, live = out.with_name(f"{out.name}.tmp{dead.pid}"), out.with_name(f"other.tmp{os.getpid()}")
    for d in (stale, live): d.mkdir(); (d / "model.safetensors").write_bytes(b"x" * 1000)
    try:
        assert resolve_model(tiny_gguf) == out                        # a normal start, nothing to convert
        assert not stale.exists() and live.exists()
    finally: __import__("shutil").rmtree(live, ignore_errors=True)

def test_damaged_cache_is_rebuilt(tiny_gguf, converted, monkeypatch):
    "Truncated, then damaged in place at the same size: each is detected at the next start and converted again."
    from llm_engine.model import resolve_model, load_model
    cache, out = converted
    monkeypatch.setenv("LLM_ENGINE_CACHE", str(cache))
    f = out / "model.safetensors"
    size, good = f.stat().st_size, f.read_bytes()[-4096:]
    with open(f, "r+b") as fh: fh.truncate(size // 2)
    assert resolve_model(tiny_gguf) == out
    assert f.stat().st_size == size and f.read_bytes()[-4096:] == good
    with open(f, "r+b") as fh: fh.seek(size - 100); fh.write(bytes(b ^ 0xFF for b in good[-100:]))   # same size, bytes flipped
    model, path = load_model(tiny_gguf)
    assert path == out and f.read_bytes()[-4096:] == good and not temp_folders(cache)
