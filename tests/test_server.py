"The real server over real HTTP, driven by the official `openai` client."
import asyncio, json, subprocess, sys
import httpx, openai, pytest

MSG = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]

@pytest.fixture(scope="module")
def client(server): return openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)

def model_id(client): return client.models.list().data[0].id

def test_models(client):
    models = client.models.list().data
    assert len(models) == 1 and models[0].id.startswith("SmolLM2-135M-Instruct")

def test_chat(client):
    r = client.chat.completions.create(model=model_id(client), messages=MSG, max_tokens=16, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

def test_chat_stream_equals_non_stream(client):
    full = client.chat.completions.create(model=model_id(client), messages=MSG, max_tokens=24, temperature=0)
    stream = client.chat.completions.create(model=model_id(client), messages=MSG, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens

def test_completions(client):
    r = client.completions.create(model=model_id(client), prompt="The capital of France is", max_tokens=8, temperature=0)
    assert "Paris" in r.choices[0].text
    r2 = client.completions.create(model=model_id(client), prompt=["1, 2, 3,", "a, b, c,"], max_tokens=4, temperature=0, echo=True)
    assert [c.index for c in r2.choices] == [0, 1] and r2.choices[1].text.startswith("a, b, c,")

def test_bad_request_gets_error_json(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_id(client), messages=[], max_tokens=4)
    assert e.value.status_code == 400
    r = httpx.post(f"{server.base}/v1/chat/completions", json={"messages": MSG, "max_tokens": -1})
    err = r.json()["error"]
    assert r.status_code == 400 and err["message"] and {"type", "param", "code"} <= set(err)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=model_id(client), prompt="hello " * 9000, max_tokens=4)

def test_n_and_stop(client):
    r = client.chat.completions.create(model=model_id(client), messages=MSG, max_tokens=12, temperature=1.0, n=2, seed=3)
    assert [c.index for c in r.choices] == [0, 1]
    full = client.completions.create(model=model_id(client), prompt="Count: 1, 2, 3, 4, 5,", max_tokens=12, temperature=0).choices[0].text
    assert "7" in full
    cut = client.completions.create(model=model_id(client), prompt="Count: 1, 2, 3, 4, 5,", max_tokens=12, temperature=0, stop=["7"])
    assert cut.choices[0].text == full[:full.index("7")] and cut.choices[0].finish_reason == "stop"

def test_concurrent_streams_equal_sequential(client, server):
    questions = [f"Tell me one fact about the number {i}." for i in range(16)]
    mid = model_id(client)
    kw = dict(model=mid, max_tokens=32, temperature=0)
    sequential = [client.chat.completions.create(messages=[{"role": "user", "content": q}], **kw).choices[0].message.content
                  for q in questions]
    async def one(ac, q):
        s = await ac.chat.completions.create(messages=[{"role": "user", "content": q}], stream=True, **kw)
        return "".join([c.choices[0].delta.content or "" async for c in s if c.choices])
    async def all_at_once():
        ac = openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)
        try: return await asyncio.gather(*[one(ac, q) for q in questions])
        finally: await ac.close()
    assert asyncio.run(all_at_once()) == sequential
    stats = httpx.get(f"{server.base}/v1/stats").json()
    assert stats["kv_blocks_used"] == 0 and stats["requests_running"] == 0
    assert stats["requests_finished"] >= 32 and stats["ttft_ms_p50"] > 0

def test_stats_and_metrics(server):
    st = httpx.get(f"{server.base}/v1/stats").json()
    for k in ("kv_blocks_total", "kv_blocks_used", "requests_running", "requests_waiting", "ttft_ms_p50", "tpot_ms_p50",
              "throughput_tok_s", "prefix_cache_hit_rate", "preemptions"):
        assert k in st
    assert st["kv_blocks_total"] == 1024
    assert "llm_engine_kv_blocks_used" in httpx.get(f"{server.base}/metrics").text
    assert httpx.get(f"{server.base}/health").json() == {"status": "ok"}

def test_disconnect_frees_blocks(server):
    "Clients that hang up mid-stream have their requests aborted and blocks freed."
    import time
    for _ in range(4):
        with httpx.stream("POST", f"{server.base}/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 400,
                          "ignore_eos": True, "stream": True}, timeout=30) as r:
            for i, line in enumerate(r.iter_lines()):
                if i > 3: break
    for _ in range(100):
        st = httpx.get(f"{server.base}/v1/stats").json()
        if st["kv_blocks_used"] == 0 and st["requests_running"] == 0: break
        time.sleep(0.1)
    assert st["kv_blocks_used"] == 0 and st["requests_running"] == 0

def test_cli_generate():
    out = subprocess.run([sys.executable, "-m", "llm_engine.cli", "generate", "The capital of France is", "--max-tokens", "8"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "Paris" in out.stdout

def test_api_key_and_sigterm():
    from conftest import Server
    s = Server("--num-blocks", "64", "--api-key", "sekret")
    try:
        assert httpx.get(f"{s.base}/v1/models").status_code == 401
        locked = openai.OpenAI(base_url=f"{s.base}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError): locked.models.list()
        ok = openai.OpenAI(base_url=f"{s.base}/v1", api_key="sekret", max_retries=0)
        assert ok.models.list().data
        assert httpx.get(f"{s.base}/v1/stats", headers={"Authorization": "Bearer sekret"}).json()["requests_finished"] == 0
    finally:
        assert s.stop() == 0     # SIGTERM: clean exit
