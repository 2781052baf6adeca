"Tensor parallelism on 2 CPU ranks (gloo): equality with one process, KV ops on every rank, and no orphan after a failure."
import os, re, signal, subprocess, sys, textwrap, time
import pytest, torch
from llm_engine.engine import LLMEngine
from llm_engine.testing import make_tiny_model
from llm_engine.sampling import SamplingParams
from llm_engine.distributed import attach_tensor_parallel, TPWorkerError

@pytest.fixture(scope="module")
def tiny(tmp_path_factory): return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))

def alive(pid):
    try: return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
    except FileNotFoundError: return False

def run_all(eng, params, prompts):
    for i, p in enumerate(prompts): eng.add_request(str(i), p, params)
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished: done[o.request_id] = (o.outputs[0].token_ids, o.error)
    return [done[str(i)] for i in range(len(prompts))]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away", "1, 2, 3, 4,"]

def test_swap_and_preemption_on_both_ranks(tiny):
    "A KV cache too small for the batch: sequences are swapped out and in; the swaps must happen on rank 1 too."
    kw = dict(model=tiny, num_blocks=8, swap_space="1MiB", attention_backend="torch", dtype="float32")
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    e1, e2 = LLMEngine(**kw), LLMEngine(**kw)
    ex = attach_tensor_parallel(e2, 2)
    try:
        assert run_all(e2, sp, PROMPTS) == run_all(e1, sp, PROMPTS)
        assert e2.scheduler.num_swaps == e1.scheduler.num_swaps > 0 and ex.num_kv_ops > 0
        assert e2.block_manager.num_free_blocks == e1.block_manager.num_free_blocks == 8
    finally: ex.close()

def test_crashed_rank_fails_requests_with_a_clear_error(tiny):
    e = LLMEngine(model=tiny, num_blocks=64, attention_backend="torch")
    ex = attach_tensor_parallel(e, 2, inject_fault=(1, 3))
    outs = run_all(e, SamplingParams(temperature=0.0, max_tokens=8), PROMPTS[:2])
    assert all(err and "rank 1 failed: RuntimeError: injected fault on rank 1 at step 3" in err for _, err in outs)
    assert [p.exitcode for p in ex.procs] == [1] and ex.closed
    assert e.block_manager.num_free_blocks == 64
    with pytest.raises(TPWorkerError, match="closed"): ex.run([([1], 0, [0])])

SCRIPT = textwrap.dedent('''
    import sys, time
    from llm_engine.distributed import TPSpec, TensorParallelExecutor
    if __name__ == "__main__":
        ex = TensorParallelExecutor(TPSpec(sys.argv[1], 2, 16, 16, attention_backend="torch"))
        ex.run([([1, 2, 3], 0, [0])])
        print("PIDS", *[p.pid for p in ex.procs], flush=True)
        time.sleep(300)
''')

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_no_orphan_when_the_engine_process_dies(tiny, tmp_path, sig):
    script = tmp_path / "tp_parent.py"; script.write_text(SCRIPT)
    p = subprocess.Popen([sys.executable, str(script), tiny], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        line = p.stdout.readline()
        pids = [int(x) for x in re.findall(r"\d+", line)]
        assert line.startswith("PIDS") and len(pids) == 1, line + p.stderr.read()
        p.send_signal(sig); p.wait(30)
        deadline = time.time() + 15
        while any(alive(x) for x in pids) and time.time() < deadline: time.sleep(0.1)
        assert not any(alive(x) for x in pids), "a tensor-parallel rank outlived its engine"
        err = p.stderr.read()
        assert "rank 1 failed, exiting" in err or "parent" in err and "is gone, exiting" in err, err
    finally:
        if p.poll() is None: p.kill()

@pytest.mark.slow
def test_default_model_tp2_equals_tp1():
    "SmolLM2-135M (9 query heads, 3 KV heads: 3 and 6 heads per rank): logits within 1e-4, greedy tokens equal."
    kw = dict(num_blocks=64, attention_backend="torch", dtype="float32")
    e1, e2 = LLMEngine(**kw), LLMEngine(**kw)
    ex = attach_tensor_parallel(e2, 2)
    try:
        ids = e1.tokenizer("The quick brown fox jumps over the lazy dog because")["input_ids"]
        work, gaps = [(ids, 0, [0, 1, 2, 3])], []
        for _ in range(12):                  # teacher-forced greedy decode: the reference token is fed to both
            a, b = e1.runner.run(work), ex.run(work)
            assert (a - b).abs().max() < 1e-4
            top2 = a[0].topk(2).values
            if a[0].argmax() != b[0].argmax(): gaps.append(float(top2[0] - top2[1]))
            n = work[0][1] + len(work[0][0])
            work = [([int(a[0].argmax())], n, [0, 1, 2, 3])]
        assert all(g < 1e-4 for g in gaps), f"argmax flipped with a logit gap of {gaps}"
        sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        assert run_all(e2, sp, PROMPTS) == run_all(e1, sp, PROMPTS)
        assert e2.block_manager.num_free_blocks == e1.block_manager.num_free_blocks == 64
    finally: ex.close()

@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="NCCL tensor parallelism needs 2 CUDA devices")
def test_nccl_tp2_on_two_gpus_matches_cpu(tiny):
    from llm_engine.model import load_model
    from llm_engine.runner import ModelRunner
    from llm_engine.distributed import TPSpec, TensorParallelExecutor
    ref = ModelRunner(load_model(tiny)[0], 16, 16, attention_backend="torch")
    ex = TensorParallelExecutor(TPSpec(tiny, 2, 16, 16, attention_backend="torch", device="cuda"))
    try:
        for work in ([(list(range(1, 30)), 0, [0, 1])], [([5], 29, [0, 1])]):
            assert (ref.run(work) - ex.run(work).cpu()).abs().max() < 1e-4
    finally: ex.close()

def test_async_engine_and_openai_app_on_two_ranks(tiny):
    "The server's path: AsyncLLMEngine's loop thread drives the collectives; the OpenAI app answers as with one process."
    import asyncio, httpx
    from llm_engine.engine import AsyncLLMEngine
    from llm_engine.api import build_app
    e1, e2 = (LLMEngine(model=tiny, num_blocks=64, attention_backend="torch", dtype="float32") for _ in range(2))
    ex = attach_tensor_parallel(e2, 2)
    body = {"prompt": "Tensor parallel", "max_tokens": 8, "temperature": 0}
    async def ask(eng):
        aeng = AsyncLLMEngine(eng).start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(aeng)), base_url="http://t") as c:
                return (await c.post("/v1/completions", json=body)).json()["choices"][0]["text"]
        finally: aeng.shutdown()
    try: assert asyncio.run(ask(e2)) == asyncio.run(ask(e1))
    finally: ex.close()
    assert [p.exitcode for p in ex.procs] == [0]

def test_cli_tensor_parallel_flag_gives_the_same_text(tiny):
    "`--tensor-parallel-size 2` on the CLI runs the engine on two ranks and prints what one process prints."
    def gen(*extra):
        r = subprocess.run([sys.executable, "-m", "llm_engine.cli", "generate", "Once upon a time", "--model", str(tiny),
                            "--max-tokens", "12", "--num-blocks", "64", *extra], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout
    assert gen("--tensor-parallel-size", "2") == gen()
