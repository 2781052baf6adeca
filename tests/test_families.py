"Each model family's tiny random model against transformers: greedy ids offline and through the server, sharded folders, clear errors."
import json, os, shutil, sys
from functools import cache
import httpx, pytest, torch
from llm_engine.testing import make_tiny_family, TINY_FAMILIES, ServerProcess
from llm_engine.engine import LLM
from llm_engine.sampling import SamplingParams
from llm_engine.model import load_model, load_tokenizer
from conftest import linked_cache

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    return", "Once upon a time, in a land far away, there lived a"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

@pytest.fixture(scope="module")
def root(tmp_path_factory): return tmp_path_factory.mktemp("families")

@pytest.fixture
def model_cache(tmp_path, monkeypatch):
    "A model cache of this test's own, sharing the real one's converted default model and compiled kernels (links: nothing rebuilt)."
    mine = linked_cache(tmp_path / "cache", with_model=True)
    monkeypatch.setenv("LLM_ENGINE_CACHE", str(mine))
    return mine

@pytest.fixture(scope="module")
def prompt_ids(root):
    tok = load_tokenizer(make_tiny_family(root / "llama3", "llama3"))
    return [tok(p)["input_ids"] for p in PROMPTS]

@cache
def hf_greedy(d, ids: tuple) -> list:
    "transformers' own greedy continuation (16 tokens, EOS not stopping it) of each prompt, at fp32."
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return [hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            for p in ids]

def ours(llm, ids): return [o.outputs[0].token_ids for o in llm.generate(ids, GREEDY, use_tqdm=False)]

def family(root, fam, prompt_ids):
    d = make_tiny_family(root / fam, fam)
    return d, hf_greedy(str(d), tuple(map(tuple, prompt_ids)))

@pytest.mark.parametrize("fam", TINY_FAMILIES)
def test_offline_greedy_equals_transformers(fam, root, prompt_ids):
    d, want = family(root, fam, prompt_ids)
    assert len(set(map(tuple, want))) == 3 and max(len(set(w)) for w in want) > 4    # not a degenerate model
    llm = LLM(model=str(d), dtype="float32")
    assert ours(llm, prompt_ids) == want                       # batched
    assert [ours(llm, [p])[0] for p in prompt_ids] == want     # alone
    # 5 tokens a step: the prompts longer than the window (8) are prefilled in chunks that cross its edge
    chunked = LLM(model=str(d), dtype="float32", max_num_batched_tokens=5)
    assert ours(chunked, prompt_ids) == want
    assert ours(chunked, prompt_ids) == want                   # again, from the prefix cache

@pytest.mark.parametrize("fam", TINY_FAMILIES)
def test_server_greedy_equals_transformers(fam, root, prompt_ids):
    d, want = family(root, fam, prompt_ids)
    cmd = [sys.executable, "-m", "llm_engine.cli", "serve", "--model", str(d), "--port", "{port}", "--dtype", "float32", "--log-level", "warning"]
    with ServerProcess(cmd, timeout=240) as srv:
        name = httpx.get(f"{srv.base}/v1/models").json()["data"][0]["id"]
        for p, w in zip(prompt_ids, want):
            r = httpx.post(f"{srv.base}/v1/completions", timeout=120, json=dict(
                model=name, prompt=p, max_tokens=16, temperature=0, ignore_eos=True, return_token_ids=True))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == w

@pytest.mark.parametrize("fam", TINY_FAMILIES)
def test_default_dtype_runs(fam, root, prompt_ids):
    "`LLM(model=DIR)` as a user starts it (auto dtype: bf16 on this kind of CPU, fast paths on) generates, close to fp32."
    d, want = family(root, fam, prompt_ids)
    llm = LLM(model=str(d))
    got = ours(llm, prompt_ids)
    assert [len(g) for g in got] == [16] * 3
    assert sum(g[0] == w[0] for g, w in zip(got, want)) >= 2, (llm.engine.config.dtype, got, want)

def test_sharded_folder_and_errors(root, prompt_ids, tmp_path, model_cache):
    cache = model_cache
    sharded = make_tiny_family(tmp_path / "sharded", "gemma3", shards=4)
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1 and (sharded / "model.safetensors.index.json").exists()
    _, want = family(root, "gemma3", prompt_ids)
    assert ours(LLM(model=str(sharded), dtype="float32"), prompt_ids) == want
    before = sorted(cache.iterdir())
    # a shard the index names is gone
    shards[0].unlink()
    with pytest.raises(FileNotFoundError, match=f"model.safetensors.index.json names 1 shard.*{shards[0].name}"): load_model(sharded)
    # a config without a field the model needs
    nofield = tmp_path / "nofield"; shutil.copytree(root / "llama3", nofield)
    cfg = json.loads((nofield / "config.json").read_text()); del cfg["intermediate_size"]
    (nofield / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"{nofield}/config.json: the config has no 'intermediate_size' field"): LLM(model=str(nofield))
    # an architecture we do not serve: the message lists the families we do
    cfg = json.loads((root / "llama3" / "config.json").read_text()); cfg["model_type"] = "falcon"
    (nofield / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config.json: Unsupported architecture: model_type='falcon'.*Gemma 2.*Phi-3"): LLM(model=str(nofield))
    assert sorted(cache.iterdir()) == before           # nothing left in the cache by the failures

# what a GGUF file can hold: llama.cpp's scale (query_pre_attn_scalar = head_dim), its Gemma 3 layer pattern, Gemma's tied head, no rope_scaling of these kinds
GGUF_FIELDS = dict(llama3=dict(rope_scaling=None), gemma2=dict(query_pre_attn_scalar=32, tie_word_embeddings=True),
                   gemma3=dict(query_pre_attn_scalar=32, layer_types=None, tie_word_embeddings=True),
                   phi3=dict(rope_scaling=None))

@pytest.mark.parametrize("fam", TINY_FAMILIES)
def test_gguf_f32_and_q8_0(fam, tmp_path, prompt_ids, model_cache):
    "The family's GGUF at F32 gives the folder's greedy ids; at Q8_0 it holds exactly the de-quantized Q8_0 blocks of the folder's weights."
    import gguf
    from llm_engine.testing import write_tiny_gguf
    d = make_tiny_family(tmp_path / fam, fam, **GGUF_FIELDS.get(fam, {}))
    want = ours(LLM(model=str(d), dtype="float32"), prompt_ids)
    f32 = write_tiny_gguf(d, tmp_path / f"{fam}-f32.gguf")
    assert ours(LLM(model=str(f32), dtype="float32"), prompt_ids) == want
    folder, _ = load_model(d)
    q8, _ = load_model(write_tiny_gguf(d, tmp_path / f"{fam}-q8_0.gguf", "Q8_0"))
    Q8 = gguf.GGMLQuantizationType.Q8_0
    for (name, p), ref in zip(q8.named_parameters(), folder.parameters()):
        if p.ndim == 2 and p.shape[1] % 32 == 0: ref = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(ref.detach().numpy(), Q8), Q8))
        assert torch.equal(p.detach(), ref.detach()), name

def test_gguf_of_an_unknown_architecture(tmp_path, model_cache):
    import gguf
    cache = model_cache
    before = sorted(cache.iterdir())
    w = gguf.GGUFWriter(tmp_path / "rwkv.gguf", "rwkv6"); w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ValueError, match=f"Could not read GGUF file {tmp_path}/rwkv.gguf: .*rwkv6.*families served: llama, mistral, qwen2"):
        load_model(tmp_path / "rwkv.gguf")
    assert sorted(cache.iterdir()) == before
