"Two replicas of the tiny model on a local Ray Serve: prefix-aware routing, aggregated metrics, and a replica killed under load."
import re, threading, time
import httpx, pytest
ray = pytest.importorskip("ray", reason="needs the optional Ray extra: pip install llm_engine[ray]")
from ray import serve
from llm_engine.testing import make_tiny_model
from llm_engine.distributed import free_port
from llm_engine.serve import serve_replicas, rendezvous, prefix_key

pytestmark = pytest.mark.slow      # starting Ray and two replicas takes ~45 s on 2 busy cores

REPLICAS = ["replica-0", "replica-1"]
SYSTEM = {"role": "system", "content": "You are a meticulous assistant for a public library; answer in one sentence. " * 40}

@pytest.fixture(scope="module")
def url(tmp_path_factory):
    tiny = str(make_tiny_model(tmp_path_factory.mktemp("tiny")))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield serve_replicas(tiny, 2, port=free_port(), num_cpus_per_replica=0.5, blocking=False, max_inflight=8,
                             num_blocks=512, attention_backend="torch")
    finally:
        serve.shutdown(); ray.shutdown()

def hit_rate(client, replica):
    "One replica's prefix-cache hit rate, read from the aggregated /metrics."
    m = client.get("/metrics").text
    return float(re.search(rf'llm_engine_prefix_cache_hit_rate{{replica="{replica}"}} (\S+)', m).group(1))

def test_shared_system_prompt_sticks_to_one_replica_and_unrelated_spread(url):
    c = httpx.Client(base_url=url, timeout=120)
    home = rendezvous(prefix_key({"messages": [SYSTEM]}), REPLICAS)[0]
    before = c.get("/router/stats").json()["routed"]
    for i in range(24):
        r = c.post("/v1/chat/completions", json={"messages": [SYSTEM, {"role": "user", "content": f"Q{i}"}], "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
    after = c.get("/router/stats").json()["routed"]
    assert after[home].get("prefix", 0) - before[home].get("prefix", 0) == 24
    # the home replica served only these requests so far: its hit rate is theirs (the first one fills the cache)
    assert hit_rate(c, home) > 0.9
    for i in range(12): assert c.post("/v1/completions", json={"prompt": f"unrelated {i} {i * 7919}", "max_tokens": 2}).status_code == 200
    spread = c.get("/router/stats").json()["routed"]
    assert all(spread[r].get("prefix", 0) - after[r].get("prefix", 0) >= 2 for r in REPLICAS), spread
    m = c.get("/metrics").text
    assert all(f'llm_engine_requests_finished{{replica="{r}"}}' in m for r in REPLICAS)

def test_streaming_and_errors_pass_through(url):
    c = httpx.Client(base_url=url, timeout=120)
    with c.stream("POST", "/v1/chat/completions", json={"messages": [SYSTEM, {"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [l for l in r.iter_lines() if l.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]

def replica_actor(name):
    hits = [a for a in ray.util.list_named_actors(all_namespaces=True) if f"#{name}#" in a["name"]]
    assert len(hits) == 1, hits
    return ray.get_actor(hits[0]["name"], namespace=hits[0]["namespace"])

def gauge(client, name, replica) -> float:
    "One replica's `llm_engine_<name>` from the aggregated /metrics (NaN while the replica is not answering)."
    m = re.search(rf'llm_engine_{name}{{replica="{replica}"}} (\S+)', client.get("/metrics").text)
    return float(m.group(1)) if m else float("nan")

MAX_TOKENS = 900     # 8 such requests fit replica-0's 512 blocks at once after the retries

def prompts_for(replica, k):
    "k prompts whose prefix hashes to `replica` first (the router sends them there while it is not overloaded)."
    ps = (f"story {i}: once upon a time {i * 31}" for i in range(10_000))
    return [p for p in ps if rendezvous(prefix_key({"prompt": p}), REPLICAS)[0] == replica][:k]

def test_killing_a_replica_under_load_loses_no_request(url):
    c = httpx.Client(base_url=url, timeout=180)
    prompts = prompts_for("replica-1", 4) + prompts_for("replica-0", 4)
    results, threads = {}, []
    base = gauge(c, "tokens_generated", "replica-1")      # what replica-1 generated before this test
    def one(i):
        body = {"prompt": prompts[i], "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
        with httpx.Client(base_url=url, timeout=180) as cl: results[i] = cl.post("/v1/completions", json=body).status_code
    for i in range(len(prompts)):
        threads.append(threading.Thread(target=one, args=(i,))); threads[-1].start()
    # kill replica-1 once its 4 requests all run and are far from done: they were prefilled together (short prompts, one
    # step), so each holds about done/4 tokens; under a quarter of max_tokens leaves each hundreds of steps (seconds)
    # from its end, so the kill lands before any of them can finish, however slow or fast the machine is
    victim, deadline, seen = replica_actor("replica-1"), time.time() + 120, []
    while True:
        running, done = gauge(c, "requests_running", "replica-1"), gauge(c, "tokens_generated", "replica-1") - base
        seen.append((running, done))
        if running == 4 and done / 4 < MAX_TOKENS / 4: break
        assert done / 4 < MAX_TOKENS / 4 and time.time() < deadline, f"replica-1 never ran its 4 requests far from done: {seen[-5:]}"
        time.sleep(0.02)
    t_kill = time.time()
    ray.kill(victim, no_restart=True)
    for t in threads: t.join(180)
    assert results == {i: 200 for i in range(len(prompts))}, results
    st = c.get("/router/stats").json()
    print(f"killed replica-1 running 4 requests {done / 4:.0f} of {MAX_TOKENS} tokens in; all {len(prompts)} answered "
          f"{time.time() - t_kill:.1f} s after the kill; router stats {st}")
    # the 4 requests running on replica-1 failed there and were answered by replica-0
    assert st["failures"].get("replica-1", 0) == 4 and st["routed"]["replica-0"].get("retry", 0) == 4, st
    r = c.post("/v1/completions", json={"prompt": "still there?", "max_tokens": 2})
    assert r.status_code == 200
