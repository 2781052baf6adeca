"""Pooling requests (embeddings, issue 25) where the engine has other machinery on: tensor parallelism (rank 0 pools
the hidden states it holds whole: the same vectors as one process, on a real 2-rank executor), speculative decoding (a pooling request is
never given drafts, and its vector is unchanged), and preemption (a recomputed or swapped pooling request still pools
every token once)."""
import asyncio
import httpx, pytest, torch
from llm_engine.engine import LLMEngine, LLM
from llm_engine.scheduler import PoolingParams
from llm_engine.sampling import SamplingParams
from llm_engine.testing import make_tiny_model
from llm_engine.embeddings import embed_rows

@pytest.fixture(scope="module")
def tiny(tmp_path_factory): return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))

def test_tensor_parallel_embeddings_equal_one_process(tiny):
    "On a real 2-rank executor: /v1/embeddings (mean) and last-token pooling, chunked, beside a completion; vectors equal one process's."
    from llm_engine.engine import AsyncLLMEngine
    from llm_engine.api import build_app
    from llm_engine.distributed import attach_tensor_parallel
    from llm_engine.embeddings import router
    kw = dict(model=tiny, num_blocks=64, attention_backend="torch", dtype="float32", max_num_batched_tokens=16)
    one, eng = LLMEngine(**kw), LLMEngine(**kw)
    ex = attach_tensor_parallel(eng, 2)
    eng.runner = ex
    docs = ["a", "b", "a longer text, long enough that its prompt is computed in more than one chunk of sixteen tokens"]
    async def ask(e):
        aeng = AsyncLLMEngine(e).start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(aeng, routers=[router])), base_url="http://t") as c:
                emb = await c.post("/v1/embeddings", json={"input": docs})
                chat = await c.post("/v1/completions", json={"prompt": "still serving", "max_tokens": 3})
                return emb, chat
        finally: aeng.shutdown()
    try:
        ids = [list(range(10, 50)), [7, 8, 9]]               # offline first: shutting the async engine down closes the ranks
        for how in ("mean", "last"):
            torch.testing.assert_close(embed_rows(eng, ids, how), embed_rows(one, ids, how), atol=1e-5, rtol=0)
        (emb, chat), (emb1, _) = asyncio.run(ask(eng)), asyncio.run(ask(one))
        assert emb.status_code == 200 == emb1.status_code, emb.text
        got, want = ([d["embedding"] for d in r.json()["data"]] for r in (emb, emb1))
        assert len(got) == 3
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)
        assert chat.status_code == 200 and eng.requests == {} and eng.block_manager.num_used_blocks == 0
    finally: ex.close()

def test_speculative_decoding_gives_no_drafts_to_a_pooling_request(tiny):
    "A pooling request left with one token to compute (where a decode is offered drafts) beside a repetitive decode."
    row = [5, 6, 7] * 4 + [5]                                        # 13 tokens, budget 12: one token left after a step
    plain = LLMEngine(model=tiny, num_blocks=64, dtype="float32", max_num_batched_tokens=12)
    spec = LLMEngine(model=tiny, num_blocks=64, dtype="float32", max_num_batched_tokens=12, num_speculative_tokens=3)
    spec.add_request("emb", row, PoolingParams()); spec.step()
    seq = spec.requests["emb"].seqs[0]
    assert seq.remaining == 1
    spec.add_request("g", [5, 6, 7] * 3, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    spec.speculator.propose(spec)
    assert seq.spec_token_ids == []
    got = {}
    while spec.has_unfinished():
        for o in spec.step(): got[o.request_id] = o
    torch.testing.assert_close(got["emb"].embedding, embed_rows(plain, [row])[0], atol=1e-5, rtol=0)
    assert spec.block_manager.num_used_blocks == 0 and spec.num_pooled_requests == 1 and spec.speculator is not None

@pytest.mark.parametrize("swap", [0, "1MiB"])
def test_a_preempted_pooling_request_pools_every_token_once(tiny, swap):
    """The embedding holds its prompt's 8 blocks and the decodes the other 4 when all four decodes need a new block: the
    embedding (the lowest priority) is preempted, recomputed from its first token or swapped out and back; same vector."""
    doc = list(range(10, 70))                                       # 60 tokens: 8 blocks of 8
    want = LLM(tiny, num_blocks=64, block_size=8, dtype="float32").embed([doc])[0].embedding
    eng = LLM(tiny, num_blocks=12, block_size=8, dtype="float32", swap_space=swap, max_num_batched_tokens=40).engine
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i in range(4): eng.add_request(f"g{i}", [3 + i] * 8, greedy)        # one full block each
    eng.add_request("emb", doc, PoolingParams(), priority=1)
    got = {}
    while eng.has_unfinished():
        for o in eng.step(): got[o.request_id] = o
    how = {"recomputed"} if not swap else {"swapped_out"}
    assert how & {r.action for r in eng.tracer.requests["emb"]}, eng.tracer.explain("emb")
    torch.testing.assert_close(got["emb"].embedding, want, atol=1e-5, rtol=0)
    assert eng.block_manager.num_used_blocks == 0 and got["emb"].finish_reason == "pooled"
