"""The 8-bit KV cache (`--kv-cache-dtype int8|fp8`, notebook 03) through the whole engine: chunked prefill, prefix
hits, n>1 (copy-on-write), preemption by swap and by recompute, windowed and soft-capped families; every block back
at the end, and the logprobs near the fp32 cache's. Then once through the server."""
import sys
import httpx, pytest, torch
from llm_engine.engine import LLM
from llm_engine.sampling import SamplingParams
from llm_engine.testing import make_tiny_family, make_tiny_model, ServerProcess

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    return", "Once upon a time, in a land far away, there lived a",
           "The capital of France is a city of"]     # the last shares the first's opening blocks (a prefix hit)

def forced_logprobs(llm, seqs):
    "Each position's logprob of the given next token, teacher-forced (prompt logprobs), over every sequence."
    outs = llm.generate(seqs, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.tensor([e[t] for o, s in zip(outs, seqs) for e, t in zip(o.prompt_logprobs[1:], s[1:])])

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv8")
    return {"llama": make_tiny_model(root / "llama", layers=2, hidden=128, heads=4, kv_heads=2),
            "gemma2": make_tiny_family(root / "gemma2", "gemma2", sliding_window=8),   # a window on alternate layers, soft caps
            "qwen3": make_tiny_family(root / "qwen3", "qwen3")}                         # q/k norms

@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3"])
@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_engine_runs_and_stays_near_the_fp32_cache(models, family, kv):
    d = str(models[family])
    # a small pool and chunked prefill: sequences are preempted (swapped, then recomputed) and chunks read the cache
    kw = dict(model=d, dtype="float32", block_size=4, num_blocks=40, max_num_batched_tokens=16, swap_space="64KiB")
    ref, q8 = LLM(**kw), LLM(**kw, kv_cache_dtype=kv)
    tok = q8.get_tokenizer()
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=24, n=2, ignore_eos=True)   # n=2: forked blocks
    outs = q8.generate(PROMPTS * 2, params, use_tqdm=False)
    assert all(len(c.token_ids) == 24 for o in outs for c in o.outputs)
    eng = q8.engine
    assert eng.block_manager.num_used_blocks == 0 and eng.scheduler.num_preemptions > 0
    assert eng.block_manager.hit_tokens > 0
    # teacher-forced over the fp32 cache's own greedy continuations: how far each logprob moves
    greedy = ref.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    seqs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in greedy]
    diff = (forced_logprobs(q8, seqs) - forced_logprobs(ref, seqs)).abs()
    # tiny random models are touchy: on the llama here even one scale per token (block_size 1) moves logprobs by 0.03 on
    # average (int8; fp8: 0.18 at block_size 4); a wrong scale or a misread block moves them by whole nats
    bound = 0.08 if kv == "int8" else 0.3
    print(family, kv, "mean |dlogprob|", round(diff.mean().item(), 4))
    assert diff.mean() < bound, (family, kv, diff.mean().item(), diff.max().item())
    assert eng.block_manager.num_used_blocks == 0 and ref.engine.block_manager.num_used_blocks == 0
    assert len(tok(PROMPTS[0])["input_ids"]) > 4

def test_server_with_an_8bit_cache(models):
    cmd = [sys.executable, "-m", "llm_engine.cli", "serve", "--port", "{port}", "--model", str(models["llama"]),
           "--dtype", "float32", "--kv-cache-dtype", "int8", "--num-blocks", "64", "--log-level", "warning"]
    with ServerProcess(cmd, timeout=240) as srv:
        r = httpx.post(srv.base + "/v1/completions", json={"model": httpx.get(srv.base + "/v1/models").json()["data"][0]["id"],
                                                           "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0, r.text
        stats = httpx.get(srv.base + "/v1/stats", timeout=10).json()
        assert stats["kv_blocks_total"] == 64 and stats["kv_blocks_used"] == 0, stats
