"""`POST /v1/embeddings` on `llm-engine serve` (the embedded model, fp32: the conftest's server), over HTTP (issue 25):
identical texts have a cosine of 1, a batch equals its inputs one by one, every input shape and both encodings agree,
bad input is a 400 naming its field; each input is a pooling request batched through the engine with the chat streams in
flight (the trace shows them in the same steps), counted in /v1/stats and /metrics, and its KV blocks all come back,
after it finishes and when its client hangs up."""
import base64, json, threading, time
import httpx, numpy as np, pytest

@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base, timeout=300) as c: yield c

@pytest.fixture(scope="module")
def served(http):
    m = http.get("/v1/models").json()["data"][0]
    return m["id"], m["max_model_len"]

def embed(http, input, **kw) -> np.ndarray:
    r = http.post("/v1/embeddings", json={"input": input, **kw})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    return np.array([d["embedding"] for d in body["data"]], dtype=np.float64)

def kv_used(http) -> int: return http.get("/v1/stats").json()["kv_blocks_used"]

TEXTS = ["The cat sat on the mat.", "Stock markets fell sharply on Monday.", "x", "The cat sat on the mat.",
         "A much longer text, to make the batch uneven: " + "one two three four five six seven eight nine ten. " * 30]

def test_identical_texts_have_cosine_one(http, served):
    e = embed(http, TEXTS, model=served[0])
    assert e.shape[0] == len(TEXTS) and e.shape[1] > 0
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-6)
    assert abs(e[0] @ e[3] - 1.0) < 1e-6
    assert e[0] @ e[1] < 0.999          # different texts are different vectors

def test_batch_equals_one_by_one(http):
    batch = embed(http, TEXTS)
    alone = np.concatenate([embed(http, t) for t in TEXTS])
    np.testing.assert_allclose(batch, alone, atol=1e-5)

def test_shapes_encodings_and_usage(http, served):
    ids = [http.post("/tokenize", json={"prompt": t}).json()["tokens"] for t in TEXTS[:3]]
    floats = embed(http, TEXTS[:3])
    np.testing.assert_allclose(embed(http, ids), floats, atol=1e-6)              # list of lists of token ids
    np.testing.assert_allclose(embed(http, ids[1])[0], floats[1], atol=1e-6)     # one list of token ids
    r = http.post("/v1/embeddings", json={"input": TEXTS[:3], "encoding_format": "base64", "user": "u-42"}).json()
    decoded = np.array([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in r["data"]])
    np.testing.assert_array_equal(decoded, floats.astype(np.float32))
    n = sum(map(len, ids))
    assert r["usage"] == {"prompt_tokens": n, "total_tokens": n} and r["model"] == served[0] and r["object"] == "list"
    width = floats.shape[1]
    assert embed(http, "x", dimensions=width).shape == (1, width)               # its own width is honest; any other is refused

@pytest.mark.parametrize("body,param,code", [
    ({"input": ""}, "input", "invalid_value"),
    ({"input": []}, "input", "invalid_value"),
    ({"input": ["a", ""]}, "input[1]", "invalid_value"),
    ({"input": [[1, 2], []]}, "input[1]", "invalid_value"),
    ({"input": [[1, 10**9]]}, "input[0]", "invalid_value"),
    ({"input": "x", "dimensions": 8}, "dimensions", "unsupported_parameter"),
    ({"input": "x", "some_unknown_field": 1}, "some_unknown_field", "unknown_parameter"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", None),
])
def test_bad_input_is_a_400_naming_it(http, body, param, code):
    r = http.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and (code is None or err["code"] == code), err

def test_over_the_context_is_a_400(http, served):
    n = served[1]
    r = http.post("/v1/embeddings", json={"input": [5] * (n + 1)})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert str(n) in r.json()["error"]["message"] and r.json()["error"]["param"] == "input"
    r = http.post("/v1/embeddings", json={"input": ["short", "word " * (n + 10)]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[1]", r.text

def stats(http) -> dict: return http.get("/v1/stats").json()

def wait_idle(http, timeout=60.0) -> dict:
    "The stats once nothing runs, waits or holds a block (a cancelled request is aborted by the engine's next step)."
    t0 = time.time()
    while time.time() - t0 < timeout:
        st = stats(http)
        if st["kv_blocks_used"] == 0 and st["requests_running"] == 0 and st["requests_waiting"] == 0: return st
        time.sleep(0.05)
    return st

def computing_steps(trace: dict) -> set:
    "The steps in which a request's tokens were computed (admitted, chunked, scheduled, swapped in), from its trace runs."
    return {s for r in trace["runs"] if r["action"] in ("admitted", "chunked", "scheduled", "swapped_in")
            for s in range(r["first"], r["last"] + 1)}

def test_batched_with_streaming_chats(http, server):
    """Embeddings (a long input in chunks among them) while greedy chats stream: each chat is unchanged, the trace shows
    embedding inputs computed in the same steps as a chat, /v1/stats and /metrics count them, and the blocks all come back."""
    chat = {"messages": [{"role": "user", "content": "Count from one to twenty."}], "max_tokens": 40, "temperature": 0}
    alone = http.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
    before = wait_idle(http)
    got, errors, ids = {}, [], []
    def stream(k):
        text = ""
        with httpx.Client(base_url=server.base, timeout=300) as c, c.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    d = json.loads(line[6:]); ids.append(d["id"])
                    text += d["choices"][0]["delta"].get("content") or ""
        got[f"chat{k}"] = text
    def embeddings():
        try: got["emb"] = [embed(http, ["word " * 1500, *TEXTS]) for _ in range(2)]
        except Exception as e: errors.append(e)
    ts = [threading.Thread(target=stream, args=(k,)) for k in range(2)] + [threading.Thread(target=embeddings)]
    for t in ts: t.start()
    for t in ts: t.join(300)
    assert not errors, errors
    assert got["chat0"] == alone and got["chat1"] == alone
    np.testing.assert_allclose(got["emb"][0], got["emb"][1], atol=1e-6)
    after = wait_idle(http)
    assert after["kv_blocks_used"] == 0 and after["kv_blocks_total"] > 0
    n_inputs = 2 * (1 + len(TEXTS))
    assert after["requests_pooled"] - before["requests_pooled"] == n_inputs
    assert after["requests_finished"] - before["requests_finished"] == n_inputs + 2
    n_tokens = sum(len(http.post("/tokenize", json={"prompt": t}).json()["tokens"]) for t in ["word " * 1500, *TEXTS])
    assert after["prompt_tokens"] - before["prompt_tokens"] >= 2 * n_tokens      # plus the chats' prompts
    metrics = http.get("/metrics").text
    assert f"llm_engine_requests_pooled {float(stats(http)['requests_pooled'])}" in metrics
    listed = http.get("/v1/debug/trace").json()["requests"]
    chat_steps = set().union(*(computing_steps(t) for cid in set(ids) for t in http.get("/v1/debug/trace", params={"request_id": cid}).json()["traces"]))
    emb_steps = set().union(*(computing_steps(http.get("/v1/debug/trace", params={"request_id": rid}).json()["traces"][0])
                              for rid in listed if rid.startswith("embd-")))
    assert chat_steps & emb_steps, "no step computed an embedding input and a chat together"

def test_cancel_on_disconnect_frees_blocks(http, server):
    "A client that hangs up mid-way: its inputs are aborted (not all of them finish), and every block comes back."
    before = wait_idle(http)
    body = {"input": ["many words in a row " * 300] * 24}
    with httpx.Client(base_url=server.base, timeout=1.5) as c:
        with pytest.raises(httpx.TimeoutException): c.post("/v1/embeddings", json=body)
    after = wait_idle(http)
    assert after["kv_blocks_used"] == 0 and after["requests_running"] == 0 and after["requests_waiting"] == 0
    assert after["requests_pooled"] - before["requests_pooled"] < 24, "the work was not cancelled"
    assert after["requests_finished"] - before["requests_finished"] == 24   # finished all the same: aborted
    assert embed(http, "still serving").shape[0] == 1

@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3"])
def test_every_family_pools_transformers_hidden_states(family, tmp_path):
    """In-process, on each family's tiny random model (fp32): the vectors are transformers' final hidden states, mean-pooled
    and normalised, and a row over the step's budget, computed in chunks, gives the vector of the row computed whole.
    (The rows compared with transformers stay within Phi-3's original context, 32: past it transformers switches a whole
    forward to LongRoPE's long factors, the engine switches per position; chapter 5c.)"""
    import torch
    from transformers import AutoModel
    from llm_engine.config import EngineConfig
    from llm_engine.engine import LLMEngine
    from llm_engine.embeddings import embed_rows
    from llm_engine.testing import make_tiny_family
    path = make_tiny_family(tmp_path, family)
    engine = lambda budget: LLMEngine(EngineConfig.create(model=path, num_blocks=64, dtype="float32", max_num_batched_tokens=budget))
    rows = [list(range(3, 33)), [7], list(range(100, 110))]
    hf = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.stack([torch.nn.functional.normalize(hf(torch.tensor([r])).last_hidden_state[0].mean(0), dim=0) for r in rows])
    small, whole = engine(12), engine(1024)
    torch.testing.assert_close(embed_rows(small, rows), want, atol=1e-5, rtol=0)
    long = list(range(200, 300))                                      # past the sliding windows (8 tokens), in 9 chunks of 12
    torch.testing.assert_close(embed_rows(small, [long]), embed_rows(whole, [long]), atol=1e-5, rtol=0)
    assert small.block_manager.num_free_blocks == small.block_manager.num_blocks
