"""A long soak against a real `llm-engine serve` on 127.0.0.1: mixed streaming / non-streaming requests on both
generation routes, n > 1, stop strings, logprobs, and clients that drop mid-stream. Bounded in time.

It prints requests sent / completed / rejected / dropped (on purpose) / lost, KV blocks leaked after the run, and the
server's RSS at start, after warm-up and at the end, with the growth after warm-up in percent. Meanwhile `/v1/stats` and
`/metrics` are read every second (`--poll 1`): any answer but a 200 is counted. With `--halves` the requests run in two
halves, each followed by settling (the engine idle, a malloc_trim interval passed); the RSS after each is compared.

    python tools/soak.py                          # 10,000 requests on the tiny random model, 24 clients
    python tools/soak.py --requests 2000 --time-limit 300 --json out.json
    python tools/soak.py --url http://127.0.0.1:8000   # against a server that is already running
    python tools/soak.py --requests 2000 --halves --max-growth 3   # RSS after the second half within 3% of the first

The helpers here (`LoggedServer`, `rss_mib`, `settle`, `run_soak`) are used by `tests/test_soak.py` and the other
reliability tests.
"""
from __future__ import annotations
import argparse, asyncio, json, os, random, shlex, sys, tempfile, time
from dataclasses import dataclass, field, asdict
from pathlib import Path
import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path: sys.path.insert(0, str(ROOT))
from llm_engine.bench import ServerProcess

# ---- a server whose log goes to a file (a PIPE nobody reads would block a chatty server)

class LoggedServer(ServerProcess):
    "`llm-engine serve ARGS` with its output in `log`; optional open-file limits `nofile=(soft, hard)` and extra env."
    def __init__(self, *args, log=None, nofile=None, env=None, timeout=240, python=sys.executable):
        self.log = Path(log or tempfile.mktemp(prefix="llm_engine_server_", suffix=".log"))
        serve = [python, "-m", "llm_engine.cli", "serve", "--port", "{port}", *map(str, args)]
        pre = ["env", *[f"{k}={v}" for k, v in (env or {}).items()]] if env else []
        if nofile: pre += ["prlimit", f"--nofile={nofile[0]}:{nofile[1]}", "--"]
        # exec all the way down, so proc.pid is the server's own pid (RSS, signals)
        script = f'exec "$@" >>{shlex.quote(str(self.log))} 2>&1'
        super().__init__(["bash", "-c", script, "serve", *pre, *serve], timeout=timeout)
    def log_text(self) -> str: return self.log.read_text(errors="replace") if self.log.exists() else ""
    def stop(self) -> int: return self.close()

def rss_mib(pid) -> float|None:
    "Resident set size of a process, MiB."
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS"): return int(line.split()[1]) / 1024
    except OSError: return None

def settle(base, timeout=30) -> dict:
    "Wait until the engine is idle; returns its last `/v1/stats`."
    deadline = time.time() + timeout
    while True:
        s = httpx.get(f"{base}/v1/stats", timeout=10).json()
        if (s["kv_blocks_used"] == 0 and s["requests_running"] == 0 and s["requests_waiting"] == 0) or time.time() > deadline: return s
        time.sleep(0.1)

def tiny_model(path=None) -> str:
    "The tiny random Llama the tests use, made once in `path` (default: a folder under the temp dir)."
    from llm_engine.engine import make_tiny_model
    return str(make_tiny_model(path or Path(tempfile.gettempdir()) / "llm_engine_tiny_soak"))

# ---- the workload

WORDS = "the a river stone light quiet seven blue under over runs sings market winter code paper".split()

def make_request(rng: random.Random, i: int) -> dict:
    "One seeded request: route, body, and how the client behaves (`drop_after` chunks, None = read to the end)."
    chat = rng.random() < 0.5
    stream = rng.random() < 0.6
    body = {"max_tokens": rng.randint(2, 40), "temperature": rng.choice([0, 0.7, 1.0, 1.5]), "seed": rng.randrange(2**31),
            "n": rng.choice([1, 1, 1, 2, 3]), "ignore_eos": rng.random() < 0.7, "stream": stream}
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))) + f" #{i}"
    if rng.random() < 0.3: body["stop"] = rng.sample(WORDS, rng.randint(1, 3))
    if rng.random() < 0.2: body["top_p"], body["top_k"] = rng.uniform(0.3, 1), rng.choice([-1, 5, 50])
    if rng.random() < 0.15: body["presence_penalty"], body["frequency_penalty"] = rng.uniform(-1, 1), rng.uniform(-1, 1)
    if stream and rng.random() < 0.3: body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
        if rng.random() < 0.1: body["logprobs"], body["top_logprobs"] = True, 2
    else:
        body["prompt"] = text if rng.random() < 0.85 else [text, text[::-1] or "x"]
        if rng.random() < 0.1: body["logprobs"] = 2
        if rng.random() < 0.1: body["echo"] = True
    if rng.random() < 0.01: body["max_tokens"] = 10**6      # refused with 400: counted as rejected
    drop_after = rng.randint(1, 4) if stream and rng.random() < 0.12 else None
    return dict(path="/v1/chat/completions" if chat else "/v1/completions", body=body, drop_after=drop_after)

@dataclass
class SoakResult:
    sent: int = 0
    completed: int = 0       # 200 with a whole answer (a JSON body, or a stream that ended with [DONE])
    rejected: int = 0        # 4xx / 503 carrying OpenAI's error JSON
    dropped: int = 0         # streams the client hung up on, on purpose
    lost: int = 0            # anything else: 5xx, a broken connection, a stream that ended early or said "error"
    lost_examples: list = field(default_factory=list)
    seconds: float = 0.0
    blocks_leaked: int|None = None
    rss_start: float|None = None
    rss_warm: float|None = None     # MiB: the peak up to the end of warm-up
    rss_end: float|None = None
    rss_peak: float|None = None
    growth_pct: float|None = None
    rss_samples: list = field(default_factory=list)   # (seconds since start, requests done, MiB)
    time_limited: bool = False
    server_errors: int = 0   # generation answers with a 5xx status (also counted in `lost`)
    polls: int = 0           # /v1/stats and /metrics reads during the run
    poll_errors: int = 0     # of those, answers other than 200 (or no answer)
    poll_error_examples: list = field(default_factory=list)
    rss_halves: list = field(default_factory=list)   # MiB after each half settled (`run_halves`)
    halves_growth_pct: float|None = None
    def line(self) -> str:
        mib = lambda v: "?" if v is None else f"{v:.0f}"
        return (f"soak: {self.sent} sent, {self.completed} completed, {self.rejected} rejected, {self.dropped} dropped by the client, "
                f"{self.lost} lost; {self.blocks_leaked} KV blocks leaked; RSS start {mib(self.rss_start)} MiB, after warm-up "
                f"{mib(self.rss_warm)} MiB, end {mib(self.rss_end)} MiB (peak {mib(self.rss_peak)}), growth after warm-up "
                f"{'?' if self.growth_pct is None else f'{self.growth_pct:+.1f}'}%; {self.server_errors} 5xx; {self.polls} stats/metrics "
                f"reads, {self.poll_errors} failed" + (f"; RSS after each half settled {' / '.join(f'{m:.0f}' for m in self.rss_halves)} MiB, "
                f"{self.halves_growth_pct:+.1f}%" if self.halves_growth_pct is not None else "") +
                f"; {self.seconds:.0f} s{' (time limit hit)' if self.time_limited else ''}")

def _is_error_json(text):
    try: e = json.loads(text)["error"]; return isinstance(e.get("message"), str) and bool(e["message"])
    except (ValueError, KeyError, TypeError): return False

async def _one(c: httpx.AsyncClient, req: dict, res: SoakResult):
    def lose(why):
        res.lost += 1
        if len(res.lost_examples) < 10: res.lost_examples.append(f"{why}: {json.dumps(req)[:300]}")
    try:
        if not req["body"]["stream"]:
            r = await c.post(req["path"], json=req["body"])
            if r.status_code == 200 and r.json().get("choices"): res.completed += 1
            elif 400 <= r.status_code < 500 or r.status_code == 503:
                if _is_error_json(r.text): res.rejected += 1
                else: lose(f"{r.status_code} without error JSON")
            else: res.server_errors += r.status_code >= 500; lose(f"status {r.status_code} {r.text[:200]}")
            return
        async with c.stream("POST", req["path"], json=req["body"]) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                if (400 <= r.status_code < 500 or r.status_code == 503) and _is_error_json(text): res.rejected += 1
                else: res.server_errors += r.status_code >= 500; lose(f"status {r.status_code} {text[:200]}")
                return
            chunks, done = 0, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "): continue
                if line == "data: [DONE]": done = True; break
                if '"error"' in line[:12]: lose(f"error event {line[:200]}"); return
                chunks += 1
                if req["drop_after"] and chunks >= req["drop_after"]: res.dropped += 1; return
            if done: res.completed += 1
            else: lose(f"stream ended without [DONE] after {chunks} chunks")
    except (httpx.HTTPError, ValueError) as e: lose(f"{type(e).__name__}: {e}")

async def _soak(base, pid, n, concurrency, time_limit, warmup, seed, sample_every, warm_time, poll_every=1.0):
    res = SoakResult()
    t0, next_i, done = time.perf_counter(), 0, 0
    res.rss_start = rss_mib(pid) if pid else None
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(120, connect=30), limits=limits) as c:
        async def client():
            nonlocal next_i, done
            while next_i < n and not stop.is_set():
                i = next_i; next_i += 1
                req = make_request(random.Random(seed * 1_000_003 + i), i)
                res.sent += 1
                await _one(c, req, res)
                done += 1
                if done == warmup and pid and res.rss_warm is None: res.rss_warm = warm_peak()
        # the highest reading up to the end of warm-up, not one reading: the engine's malloc_trim makes RSS saw up and down,
        # and one reading in a trough (534 MiB between peaks of 634 on a Zen 4) made the same working set look like +17%
        def warm_peak(): return max([rss_mib(pid) or 0] + [m for *_, m in res.rss_samples])
        async def watch():
            while not stop.is_set():
                el = time.perf_counter() - t0
                if pid: res.rss_samples.append((round(el, 1), done, round(rss_mib(pid) or 0, 1)))
                if pid and res.rss_warm is None and el >= warm_time: res.rss_warm = warm_peak()   # warm by time if not by count
                if el > time_limit: res.time_limited = True; stop.set(); break
                try: await asyncio.wait_for(stop.wait(), sample_every)
                except asyncio.TimeoutError: pass
        async def poll():      # what a dashboard does: the engine's numbers read while the step thread writes them
            while poll_every and not stop.is_set():
                for path in ("/v1/stats", "/metrics"):
                    try: ok = (await c.get(path)).status_code == 200; why = "status"
                    except httpx.HTTPError as e: ok, why = False, f"{type(e).__name__}: {e}"
                    res.polls += 1
                    if not ok:
                        res.poll_errors += 1
                        if len(res.poll_error_examples) < 10: res.poll_error_examples.append(f"{path}: {why}")
                try: await asyncio.wait_for(stop.wait(), poll_every)
                except asyncio.TimeoutError: pass
        w, p = asyncio.create_task(watch()), asyncio.create_task(poll())
        await asyncio.gather(*[client() for _ in range(concurrency)])
        stop.set(); await w; await p
    res.seconds = time.perf_counter() - t0
    return res

def run_soak(base, pid=None, requests=10_000, concurrency=24, time_limit=900, warmup=None, seed=0, sample_every=2.0,
             poll_every=1.0) -> SoakResult:
    """Drive the soak against `base`; `pid` is the server's process id (for RSS). Warm-up ends after the first `warmup`
    requests (default 20%) or 40% of the time limit, whichever comes first. `/v1/stats` and `/metrics` are read every
    `poll_every` seconds (0: never)."""
    warmup = warmup or max(1, requests // 5)
    res = asyncio.run(_soak(base, pid, requests, concurrency, time_limit, warmup, seed, sample_every, 0.4 * time_limit, poll_every))
    s = settle(base)
    res.blocks_leaked = s["kv_blocks_used"]
    if pid:
        time.sleep(1.0)
        res.rss_end = rss_mib(pid)
        res.rss_peak = max([m for *_, m in res.rss_samples] + [res.rss_end])
        res.growth_pct = 100 * (res.rss_end - res.rss_warm) / res.rss_warm
    return res

def run_halves(base, pid, requests=10_000, concurrency=24, time_limit=900, seed=0, settle_s=12.0, poll_every=1.0) -> SoakResult:
    """The soak in two halves (different requests, same mix), each followed by settling: the engine idle, then `settle_s`
    seconds (longer than the engine's malloc_trim interval) before reading RSS. `halves_growth_pct` compares the two."""
    def half(k):
        r = run_soak(base, pid, requests // 2, concurrency, time_limit / 2, seed=seed * 2 + k, poll_every=poll_every)
        time.sleep(settle_s)
        return r, rss_mib(pid)
    (a, m1), (b, m2) = half(0), half(1)
    res = SoakResult(**{k: getattr(a, k) + getattr(b, k) for k in ("sent", "completed", "rejected", "dropped", "lost", "seconds",
                                                                   "server_errors", "polls", "poll_errors")})
    res.lost_examples, res.poll_error_examples = a.lost_examples + b.lost_examples, a.poll_error_examples + b.poll_error_examples
    res.blocks_leaked, res.time_limited = max(a.blocks_leaked, b.blocks_leaked), a.time_limited or b.time_limited
    res.rss_start, res.rss_warm, res.rss_end = a.rss_start, a.rss_warm, b.rss_end
    res.rss_peak, res.growth_pct = max(a.rss_peak, b.rss_peak), 100 * (b.rss_end - a.rss_warm) / a.rss_warm
    res.rss_samples = a.rss_samples + [(t + a.seconds + settle_s, d + a.sent, m) for t, d, m in b.rss_samples]
    res.rss_halves, res.halves_growth_pct = [m1, m2], 100 * (m2 - m1) / m1
    return res

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10_000); ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--time-limit", type=float, default=1200, help="seconds; stop sending after this")
    ap.add_argument("--warmup", type=int, default=None, help="requests before the warm RSS reading (default 20%%)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="model for the server (default: the tiny random Llama)")
    ap.add_argument("--url", default=None, help="soak a running server instead (no RSS unless --pid)")
    ap.add_argument("--pid", type=int, default=None)
    ap.add_argument("--server-args", default="--num-blocks 1024 --max-num-seqs 32 --max-model-len 512",
                    help="extra arguments for `llm-engine serve`")
    ap.add_argument("--log", default=None, help="server log file"); ap.add_argument("--json", default=None, help="write the result here")
    ap.add_argument("--max-growth", type=float, default=None, help="exit 1 if RSS grows more than this %% after warm-up (between the halves with --halves)")
    ap.add_argument("--halves", action="store_true", help="two halves, RSS compared after each settles")
    ap.add_argument("--poll", type=float, default=1.0, help="read /v1/stats and /metrics every this many seconds (0: never)")
    a = ap.parse_args(argv)
    srv = None
    if a.url: base, pid = a.url, a.pid
    else:
        srv = LoggedServer("--model", a.model or tiny_model(), "--log-level", "warning", *shlex.split(a.server_args), log=a.log)
        base, pid = srv.base, srv.proc.pid
        print(f"server pid {pid} on {base}, log {srv.log}", flush=True)
    try:
        res = (run_halves(base, pid, a.requests, a.concurrency, a.time_limit, a.seed, poll_every=a.poll) if a.halves else
               run_soak(base, pid, a.requests, a.concurrency, a.time_limit, a.warmup, a.seed, poll_every=a.poll))
    finally:
        rc = srv.stop() if srv else None
    print(res.line())
    for ex in res.lost_examples: print("  lost:", ex)
    for ex in res.poll_error_examples: print("  stats/metrics failed:", ex)
    if srv:
        log = srv.log_text()
        print(f"server exit code {rc}; log {len(log.splitlines())} lines, {log.count('Traceback')} tracebacks")
    if a.json: Path(a.json).write_text(json.dumps(asdict(res), indent=1))
    growth = res.halves_growth_pct if a.halves else res.growth_pct
    ok = (res.lost == 0 and res.blocks_leaked == 0 and res.poll_errors == 0 and
          (a.max_growth is None or growth is None or growth < a.max_growth))
    return 0 if ok else 1

if __name__ == "__main__": sys.exit(main())
