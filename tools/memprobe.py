"""Where does the server's memory go? Serve the tiny model in this process with a few probe routes, soak it, and
report RSS next to what Python itself holds (tracemalloc), object counts (gc), the engine's logs and the effect of
`malloc_trim`.

    python tools/memprobe.py --requests 1500                   # as the server runs today
    python tools/memprobe.py --requests 1500 --no-mallopt      # without keep_freed_memory()'s mallopt
    python tools/memprobe.py --requests 1500 --tracemalloc     # + which lines allocated what survives (slow)

Probe routes (this tool only, never in the real server): GET /_mem, POST /_mem/trim, GET /_mem/top.
"""
from __future__ import annotations
import argparse, collections, ctypes, gc, json, os, sys, threading, time, tracemalloc
from pathlib import Path
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import rss_mib, run_soak, tiny_model, settle
from llm_engine.testing import _free_port

def _libc(): return ctypes.CDLL("libc.so.6")

def smaps() -> dict:
    "Resident MiB of this process by kind of mapping: the main heap, anonymous maps (malloc arenas, big blocks), files."
    out, kind = collections.Counter(), None
    for line in open("/proc/self/smaps"):
        parts = line.split()
        if parts and "-" in parts[0] and len(parts) >= 5 and not parts[0].endswith(":"):
            name = parts[5] if len(parts) > 5 else ""
            kind = "heap" if name == "[heap]" else "anon" if name == "" else "stack" if name.startswith("[stack") else "file"
        elif parts and parts[0] == "Rss:": out[kind] += int(parts[1]) / 1024
    return {k: round(v, 1) for k, v in out.items()}

def mem_report(aeng) -> dict:
    eng = aeng.engine
    counts = collections.Counter(type(o).__name__ for o in gc.get_objects())
    interesting = {k: counts.get(k, 0) for k in ("Sequence", "_Request", "RequestOutput", "CompletionOutput", "RequestMetrics",
                                                 "IncrementalDetokenizer", "Queue", "Future", "Task", "Generator", "Tensor", "dict", "list", "tuple")}
    py = tracemalloc.get_traced_memory()[0] / 2**20 if tracemalloc.is_tracing() else None
    return dict(rss=rss_mib(os.getpid()), smaps=smaps(), threads=threading.active_count(), python_traced_mib=py, gc_objects=len(gc.get_objects()), types=interesting,
                finished_log=len(eng.finished_log), token_log=len(eng.token_log), requests=len(eng.requests),
                streams=len(aeng._streams), block_manager=dict(tables=len(eng.block_manager.tables), cached=len(eng.block_manager.cached),
                num_hashed=len(eng.block_manager.num_hashed), cpu_tables=len(eng.block_manager.cpu_tables)),
                torch_threads=__import__("torch").get_num_threads())

def build(model, no_mallopt, server_kw, no_prepack=False):
    import llm_engine.model as M
    if no_prepack: M.prepack_linears = lambda m: m
    if no_mallopt: M.keep_freed_memory = lambda: False     # noqa: the probe compares both allocators
    from llm_engine.engine import LLMEngine, AsyncLLMEngine
    from llm_engine.config import EngineConfig
    from llm_engine.api import build_app
    aeng = AsyncLLMEngine(LLMEngine(EngineConfig.create(model=model, **server_kw))).start()
    app = build_app(aeng)
    state = {}
    @app.get("/_mem")
    def _mem(): gc.collect(); return mem_report(aeng)
    @app.post("/_mem/trim")
    def _trim():
        gc.collect(); before = rss_mib(os.getpid()); _libc().malloc_trim(0); return dict(before=before, after=rss_mib(os.getpid()))
    @app.post("/_mem/snap")
    def _snap(): gc.collect(); state["snap"] = tracemalloc.take_snapshot() if tracemalloc.is_tracing() else None; return {}
    @app.get("/_mem/top")
    def _top():
        gc.collect()
        if not state.get("snap"): return []
        diff = tracemalloc.take_snapshot().compare_to(state["snap"], "lineno")
        return [str(d) for d in diff[:15]]
    return aeng, app

def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1500); ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--no-mallopt", action="store_true"); ap.add_argument("--no-prepack", action="store_true")
    ap.add_argument("--trim-every", type=float, default=0, help="call malloc_trim(0) every this many seconds (0: never)"); ap.add_argument("--tracemalloc", action="store_true")
    ap.add_argument("--time-limit", type=float, default=900); ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.tracemalloc: tracemalloc.start(8)
    import uvicorn
    aeng, app = build(tiny_model(), a.no_mallopt, dict(num_blocks=1024, max_num_seqs=32, max_model_len=512), a.no_prepack)
    if a.trim_every:
        def trimmer():
            while True: time.sleep(a.trim_every); _libc().malloc_trim(0)
        threading.Thread(target=trimmer, daemon=True).start()
    port = _free_port(); base = f"http://127.0.0.1:{port}"
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    while True:
        try:
            if httpx.get(base + "/health").status_code == 200: break
        except httpx.HTTPError: time.sleep(0.2)
    rep = {"start": httpx.get(base + "/_mem").json()}
    res_w = run_soak(base, os.getpid(), a.requests // 5, a.concurrency, a.time_limit, seed=1)   # warm-up
    rep["warm"] = httpx.get(base + "/_mem").json()
    httpx.post(base + "/_mem/snap")
    res = run_soak(base, os.getpid(), a.requests, a.concurrency, a.time_limit, seed=2)
    rep["end"] = httpx.get(base + "/_mem").json()
    rep["top_since_warm"] = httpx.get(base + "/_mem/top").json()
    rep["trim"] = httpx.post(base + "/_mem/trim").json()
    rep["soak"] = dict(warmup=res_w.line(), main=res.line())
    print(json.dumps(rep, indent=1))
    if a.json: Path(a.json).write_text(json.dumps(rep, indent=1))
    server.should_exit = True; aeng.shutdown()

if __name__ == "__main__": main()
