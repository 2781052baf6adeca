"Tensor parallelism (chapter 11b) on a model with biases on its row-parallel o_proj and down_proj (added once, after the all-reduce): greedy ids equal one process."
import pytest, torch
from llm_engine.engine import LLMEngine
from llm_engine.sampling import SamplingParams
from llm_engine.testing import make_tiny_family
from llm_engine.distributed import attach_tensor_parallel

@pytest.fixture(scope="module")
def biased(tmp_path_factory):
    "A tiny Llama with attention_bias (q, k, v and o_proj biases) and mlp_bias, every bias random (transformers starts them at 0)."
    from transformers import AutoModelForCausalLM
    d = make_tiny_family(tmp_path_factory.mktemp("bias") / "llama", "llama3", attention_bias=True, mlp_bias=True)
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith(".bias"): p.normal_(0.0, 0.5)
    m.save_pretrained(d)
    return str(d)

def run_all(eng, params, prompts):
    for i, p in enumerate(prompts): eng.add_request(str(i), p, params)
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished: done[o.request_id] = o.outputs[0].token_ids
    return [done[str(i)] for i in range(len(prompts))]

def test_row_parallel_bias_is_added_once(biased):
    kw = dict(model=biased, num_blocks=64, attention_backend="torch", dtype="float32")
    e1, e2 = LLMEngine(**kw), LLMEngine(**kw)
    mc = e1.model.config
    assert mc.o_proj_bias and mc.mlp_bias and e1.model.layers[0].self_attn.o_proj.bias.abs().sum() > 0
    ex = attach_tensor_parallel(e2, 2)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
        want = run_all(e1, sp, prompts)
        assert len(set(map(tuple, want))) == 3
        assert run_all(e2, sp, prompts) == want
    finally: ex.close()
