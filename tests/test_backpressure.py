"""Backpressure: SSE clients that stop reading must not keep the engine working for them, nor slow anyone else.

A stalled reader is a raw socket with a tiny receive buffer that sends a streaming request and never reads.
With `--stream-stall-action pause` its request stops being computed once its client has left an output unread
for `--stream-stall-timeout` seconds (its KV blocks stay), and resumes when the client reads again; with
`abort` it is cancelled and its blocks freed. Other clients' time to first token is measured before and during the
stall (printed; not asserted, the machine is shared), and the engine's own counters show that the stalled
requests take no steps."""
import asyncio, json, socket, sys, time
from pathlib import Path
import httpx, pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from soak import LoggedServer, settle, tiny_model, rss_mib

STALL_BODY = {"messages": [{"role": "user", "content": "tell me a long story"}], "max_tokens": 440, "ignore_eos": True,
              "stream": True, "n": 4, "logprobs": True, "top_logprobs": 5}

def stalled_client(port, path="/v1/chat/completions", body=STALL_BODY) -> socket.socket:
    "Send one streaming request and never read the answer (a 4 KiB receive buffer, so the server feels it soon)."
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s

def drain(s: socket.socket, seconds=2.0) -> int:
    "Read what the server sent so far (the client wakes up); returns bytes read."
    s.settimeout(0.2); n, end = 0, time.time() + seconds
    while time.time() < end:
        try:
            b = s.recv(1 << 16)
            if not b: break
            n += len(b)
        except (socket.timeout, BlockingIOError): pass
    return n

def ttfts(base, k=6) -> list[float]:
    "Time to first streamed token of `k` short requests, one after another, seconds."
    out = []
    with httpx.Client(base_url=base, timeout=60) as c:
        for i in range(k):
            t = time.perf_counter()
            with c.stream("POST", "/v1/completions", json={"prompt": f"quick {i}", "max_tokens": 4, "stream": True, "ignore_eos": True}) as r:
                lines = r.iter_lines()
                for line in lines:
                    if line.startswith("data: ") and '"text"' in line: out.append(time.perf_counter() - t); break
                for _ in lines: pass
    return out

def stats(base): return httpx.get(base + "/v1/stats", timeout=10).json()

def wait_until(pred, timeout=30, every=0.2):
    end = time.time() + timeout
    while time.time() < end:
        v = pred()
        if v: return v
        time.sleep(every)
    return pred()

def med(xs): xs = sorted(xs); return xs[len(xs) // 2]

@pytest.fixture(scope="module")
def tiny(): return tiny_model()

def _server(tiny, action):
    return LoggedServer("--model", tiny, "--num-blocks", "1024", "--max-num-seqs", "64", "--max-model-len", "512",
                        "--log-level", "warning", "--stream-stall-timeout", "2", "--stream-stall-action", action)

def test_stalled_readers_are_paused(tiny):
    srv = _server(tiny, "pause")
    socks = []
    try:
        base_ttft = ttfts(srv.base)
        socks = [stalled_client(srv.port) for _ in range(6)]
        # the stalled requests are paused once their clients leave output unread for 2 s
        st = wait_until(lambda: (s := stats(srv.base))["requests_paused"] == 6 and s, timeout=60)
        assert st and st["requests_paused"] == 6, stats(srv.base)
        t0 = stats(srv.base)["tokens_generated"]; time.sleep(2.0); t1 = stats(srv.base)["tokens_generated"]
        assert t1 == t0, f"paused requests still generate: {t1 - t0} tokens in 2 s"
        assert stats(srv.base)["kv_blocks_used"] > 0        # paused, not dropped: their KV stays
        stalled_ttft = ttfts(srv.base)
        print(f"\nstalled readers (pause): 6 clients x n=4 paused; other clients' TTFT p50 {med(base_ttft)*1e3:.0f} ms before, "
              f"{med(stalled_ttft)*1e3:.0f} ms with the stalled ones present; tokens while paused: {t1 - t0}")
        # one client reads again: its request resumes and finishes
        got = drain(socks[0], 3.0)
        assert got > 0
        assert wait_until(lambda: stats(srv.base)["tokens_generated"] > t1, timeout=20)
        for s in socks: s.close()
        socks = []
        st = settle(srv.base, timeout=30)
        assert st["kv_blocks_used"] == 0 and st["requests_running"] == 0, {k: st[k] for k in ("kv_blocks_used", "requests_running", "requests_paused", "streams_stalled", "requests_finished", "requests_waiting")}
    finally:
        for s in socks: s.close()
        assert srv.stop() == 0

def test_stalled_readers_are_aborted(tiny):
    srv = _server(tiny, "abort")
    socks = []
    try:
        base_ttft = ttfts(srv.base)
        socks = [stalled_client(srv.port) for _ in range(6)]
        # aborted after 2 s without a read: blocks freed while the sockets are still open
        st = wait_until(lambda: (s := stats(srv.base))["kv_blocks_used"] == 0 and s["requests_running"] == 0 and s, timeout=60)
        assert st, stats(srv.base)
        stalled_ttft = ttfts(srv.base)
        st = settle(srv.base)
        print(f"\nstalled readers (abort): 6 clients x n=4 aborted; other clients' TTFT p50 {med(base_ttft)*1e3:.0f} ms before, "
              f"{med(stalled_ttft)*1e3:.0f} ms after; kv_blocks_used={st['kv_blocks_used']}")
        assert st["kv_blocks_used"] == 0 and st["requests_paused"] == 0
    finally:
        for s in socks: s.close()
        assert srv.stop() == 0

def test_stream_memory_is_bounded(tiny):
    "A stalled client holds at most one pending output in the engine, however long its request runs (no queue grows)."
    from llm_engine.engine import LLMEngine, AsyncLLMEngine
    from llm_engine.config import EngineConfig
    from llm_engine.sampling import SamplingParams
    aeng = AsyncLLMEngine(LLMEngine(EngineConfig.create(model=tiny, num_blocks=256, stream_stall_timeout=0))).start()
    async def main():
        gen = aeng.generate("hello", SamplingParams(max_tokens=200, ignore_eos=True, n=2))
        first = await gen.__anext__()
        await asyncio.sleep(0)       # do not read: the engine runs the request to its end meanwhile
        await asyncio.to_thread(wait_until, lambda: not aeng.engine.has_unfinished(), 60)
        pending = aeng.pending_outputs(first.request_id)
        outs = [o async for o in gen]
        return pending, outs
    try:
        pending, outs = asyncio.run(main())
        assert pending <= 1, pending
        assert outs[-1].finished and [len(c.token_ids) for c in outs[-1].outputs] == [200, 200]
        assert aeng.engine.block_manager.num_used_blocks == 0
    finally:
        aeng.shutdown()
