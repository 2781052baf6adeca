"""Fuzz the real server from outside: schemathesis over its `/openapi.json` (valid and invalid bodies for every route),
plus hypothesis bodies that put extreme floats (and NaN / Infinity, which Python's JSON reader accepts) into every
numeric field of the two generation requests. Counts the answers by status, every 5xx, and the tracebacks the
server wrote to its log.

    python tools/fuzz.py                     # 3,000+ cases on the tiny random model
    python tools/fuzz.py --cases 600 --json out.json

`run_fuzz` is used by `tests/test_fuzz.py` with fewer cases.
"""
from __future__ import annotations
import argparse, asyncio, collections, json, math, random, sys, time
from dataclasses import dataclass, field, asdict
from pathlib import Path
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import LoggedServer, settle, tiny_model

GEN_ROUTES = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest"}
# streams that run until their client leaves (the page's live state, chapter 10b): no answer there ever completes
ENDLESS_ROUTES = {"/v1/debug/state"}
BASE_BODY = {"/v1/completions": {"prompt": "hello there", "max_tokens": 4},
             "/v1/chat/completions": {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}}
EXTREMES = [0, -0.0, 1, -1, 0.5, -2.5, 4e-203, -4e-203, 5e-324, -5e-324, 1e-45, 1e-8, 1e38, 1e308, -1e308,
            1.7976931348623157e308, 2**31, 2**53 + 1, 2**63 - 1, 2**63, -2**63, 2**64, 10**30, -10**30,
            math.nan, math.inf, -math.inf,
            # float32's edges: finite in JSON and float64, infinite or zero in the float32 the sampler uses
            1.7e306, 3.5e38, 3.4e38, -3.5e38, 1.3e-15, 1.2e-38, 1e-40, -1e-40]
# fields whose pairs broke the sampler once (temperature 1.7e306 with repetition_penalty 1.3e-15): every pair of them
# at every float32 edge is a case of its own
PAIR_FIELDS = ["temperature", "repetition_penalty", "top_p", "min_p", "presence_penalty", "frequency_penalty"]
PAIR_VALUES = [1.7e306, 3.5e38, 3e38, 1.3e-15, 1e-40, 5e-324, 1.5e-5]

# ---- cases: (method, path, raw body bytes or None, what made it)

@dataclass
class Case:
    method: str
    path: str
    body: bytes|None
    source: str
    query: dict = field(default_factory=dict)

def _dumps(obj) -> bytes: return json.dumps(obj, allow_nan=True).encode()   # NaN / Infinity on purpose

def numeric_fields(openapi: dict) -> dict:
    "`{route: [field names whose schema admits a number or integer]}` for the generation routes, read from the served schema."
    comps = openapi["components"]["schemas"]
    def numeric(s):
        if s.get("type") in ("number", "integer"): return True
        return any(numeric(x) for x in s.get("anyOf", []) + s.get("oneOf", []))
    return {route: sorted(k for k, s in comps[name]["properties"].items() if numeric(s)) for route, name in GEN_ROUTES.items()
            if name in comps}

def extreme_cases(openapi: dict) -> list[Case]:
    "Every numeric field of each generation request set to every extreme value, the rest of the body valid."
    out = []
    for route, names in numeric_fields(openapi).items():
        for f in names:
            for v in EXTREMES:
                for stream in (False, True):
                    out.append(Case("POST", route, _dumps({**BASE_BODY[route], f: v, "stream": stream}), f"extreme:{f}"))
    return out

def pair_cases() -> list[Case]:
    "Two of `PAIR_FIELDS` at float32 edges at once, with a logit_bias, on both routes."
    out = []
    for route, body in BASE_BODY.items():
        for i, f in enumerate(PAIR_FIELDS):
            for g in PAIR_FIELDS[i + 1:]:
                for v in PAIR_VALUES:
                    for w in PAIR_VALUES:
                        out.append(Case("POST", route, _dumps({**body, f: v, g: w, "logit_bias": {"5": -100}}), f"pair:{f}+{g}"))
    return out

def hypothesis_cases(openapi: dict, n: int, seed=0) -> list[Case]:
    "Random bodies that set several numeric fields at once, to extreme floats, NaN, infinities or big integers."
    from hypothesis import given, settings, strategies as st, HealthCheck, Phase, seed as hseed
    fields = numeric_fields(openapi)
    num = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(EXTREMES),
                    st.integers(-2**70, 2**70), st.floats(-3, 3), st.integers(-2, 40))
    strat = st.sampled_from(sorted(fields)).flatmap(lambda route: st.tuples(
        st.just(route), st.dictionaries(st.sampled_from(fields[route]), num, min_size=1, max_size=5), st.booleans()))
    out = []
    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @hseed(seed)
    @given(strat)
    def collect(t):
        route, nums, stream = t
        out.append(Case("POST", route, _dumps({**BASE_BODY[route], **nums, "stream": stream}), "hypothesis"))
    collect()
    random.Random(seed).shuffle(out)
    return out[:n]

def schemathesis_cases(base: str, n: int, seed=0) -> list[Case]:
    "Valid and invalid requests for every route in the served OpenAPI schema, drawn by schemathesis."
    import schemathesis
    from schemathesis.generation import GenerationMode
    from hypothesis import given, settings, HealthCheck, Phase, seed as hseed
    from hypothesis.errors import Unsatisfiable
    schema = schemathesis.openapi.from_url(base + "/openapi.json")
    ops = [op for op in (r.ok() for r in schema.get_all_operations()) if op.path not in ENDLESS_ROUTES]
    weights = {op: (8 if op.path in GEN_ROUTES else 1) for op in ops}    # generation routes get most of the cases
    total, out = sum(weights.values()), []
    for op in ops:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            k = max(2, n * weights[op] // total // 2)
            @settings(max_examples=k, database=None, deadline=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck))
            @hseed(seed)
            @given(op.as_strategy(mode))
            def collect(case):
                kw = case.as_transport_kwargs(base_url="")
                body = _dumps(kw["json"]) if "json" in kw else kw.get("data")
                if isinstance(body, str): body = body.encode()
                out.append(Case(op.method.upper(), op.path, body, f"schemathesis:{mode.value}", kw.get("params") or {}))
            try: collect()
            except Unsatisfiable: pass     # e.g. no invalid request exists for a route without inputs
    return out

# ---- running them

@dataclass
class FuzzResult:
    cases: int = 0
    by_status: dict = field(default_factory=dict)
    by_source: dict = field(default_factory=dict)
    server_errors: int = 0          # 5xx answers
    hangs: int = 0                  # no answer within the timeout, or a broken connection
    bad_error_json: int = 0         # a 4xx that is not OpenAI's error JSON
    examples: list = field(default_factory=list)
    tracebacks: int|None = None
    log_lines: int|None = None
    blocks_leaked: int|None = None
    seconds: float = 0.0
    def line(self) -> str:
        return (f"fuzz: {self.cases} cases ({', '.join(f'{k} {v}' for k, v in sorted(self.by_source.items()))}); statuses "
                f"{dict(sorted(self.by_status.items()))}; {self.server_errors} 5xx, {self.hangs} hangs, {self.bad_error_json} 4xx "
                f"without error JSON; server log: {self.log_lines} lines, {self.tracebacks} tracebacks; {self.blocks_leaked} KV "
                f"blocks leaked; {self.seconds:.0f} s")

async def _send_all(base, cases, concurrency, timeout, res: FuzzResult):
    it = iter(cases)
    status, source = collections.Counter(), collections.Counter()
    async with httpx.AsyncClient(base_url=base, timeout=timeout, limits=httpx.Limits(max_connections=concurrency)) as c:
        async def worker():
            for case in it:
                source[case.source.split(":")[0]] += 1
                try:
                    r = await c.request(case.method, case.path, content=case.body, params=case.query,
                                        headers={"content-type": "application/json"} if case.body is not None else {})
                    code = r.status_code
                except httpx.HTTPError as e:
                    code = f"{type(e).__name__}"; res.hangs += 1
                status[code] += 1
                bad = isinstance(code, int) and code >= 500
                if isinstance(code, int) and 400 <= code < 500:
                    try: ok = isinstance(r.json()["error"]["message"], str)
                    except (ValueError, KeyError, TypeError): ok = False
                    if not ok: res.bad_error_json += 1; bad = True
                res.server_errors += isinstance(code, int) and code >= 500
                if (bad or not isinstance(code, int)) and len(res.examples) < 20:
                    res.examples.append(f"{code} {case.method} {case.path} {(case.body or b'')[:300]!r} -> "
                                        f"{r.text[:200] if isinstance(code, int) else ''}")
        await asyncio.gather(*[worker() for _ in range(concurrency)])
    res.cases = sum(status.values())
    res.by_status = {str(k): v for k, v in status.items()}
    res.by_source = dict(source)

def run_fuzz(base, n=3000, log_text=None, concurrency=8, timeout=60, seed=0) -> FuzzResult:
    """About `n` cases: a fifth extreme-float grid (capped), a tenth float32-edge pairs, the rest split between schemathesis
    and hypothesis; `seed` changes which are drawn."""
    t0 = time.perf_counter()
    openapi = httpx.get(base + "/openapi.json", timeout=30).json()
    grid, pairs = extreme_cases(openapi), pair_cases()
    random.Random(seed).shuffle(grid); random.Random(seed).shuffle(pairs)
    grid = grid[:max(n // 5, min(len(grid), n // 3))] + pairs[:n // 10]
    rest = n - len(grid)
    schema_cases = schemathesis_cases(base, rest // 2, seed)
    cases = grid + schema_cases + hypothesis_cases(openapi, n - len(grid) - len(schema_cases), seed)
    random.Random(seed + 1).shuffle(cases)
    res = FuzzResult()
    asyncio.run(_send_all(base, cases, concurrency, timeout, res))
    res.blocks_leaked = settle(base)["kv_blocks_used"]
    if log_text is not None:
        log = log_text()
        res.tracebacks, res.log_lines = log.count("Traceback (most recent call last)"), len(log.splitlines())
    res.seconds = time.perf_counter() - t0
    return res

SERVER_ARGS = ("--num-blocks", "256", "--max-model-len", "96", "--max-num-seqs", "16", "--log-level", "warning")

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=3000); ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--model", default=None); ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", default=None); ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    srv = LoggedServer("--model", a.model or tiny_model(), *SERVER_ARGS, log=a.log)
    try: res = run_fuzz(srv.base, a.cases, srv.log_text, a.concurrency, seed=a.seed)
    finally: rc = srv.stop()
    print(res.line())
    for ex in res.examples: print("  ", ex)
    log = srv.log_text()
    if res.tracebacks: print("first traceback in the server log:\n" + log[log.index("Traceback"):][:3000])
    print(f"server exit code {rc}; log {srv.log}")
    if a.json: Path(a.json).write_text(json.dumps(asdict(res), indent=1))
    return 0 if res.server_errors == 0 and res.hangs == 0 and not res.tracebacks and res.blocks_leaked == 0 else 1

if __name__ == "__main__": sys.exit(main())
