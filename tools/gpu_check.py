#!/usr/bin/env python
"""One-shot check of llm_engine's CUDA path on a GPU machine (run through tools/gpu_check.sh from a fresh clone).

Sections, each PASS / FAIL / SKIP with a reason:
  env        versions, GPU, Triton, FlashAttention; whether the engine is device-aware (`EngineConfig.device`)
  kernel     Triton paged decode == its torch reference == dense SDPA (fp32, bf16); flat prefill == notebook 03
  gpu_tests  the pytest tests marked `cuda` in tests/test_cuda.py (skipped there without a GPU)
  parity     our Llama on the device in fp32 vs transformers on the same device: last-token logits, 32 greedy tokens
  graphs     greedy decoding through CUDAGraphRunner (captured graphs) == transformers; ms per decode step, eager vs graph
  engine     LLM(device=...) in fp32 (CUDA graphs on, the default): greedy == transformers, batch == alone, every KV block back
  engine_graphs  the engine with CUDA graphs vs `enforce_eager=True`: identical greedy tokens (fp32 and bf16), decode steps
             replayed (counted), and ms per output token with and without graphs at batch 1 and 8 (measured, never asserted);
             on the CPU, the same plumbing through the stand-in recorder (`record_eagerly`), no timing
  throughput LLM(device=...) vs transformers `generate` one request at a time, same GPU, same dtype (the claim: ~15x)

Exit status: 0 all checks that ran passed, 1 a check failed, 2 the machine cannot run the checks.
`--device cpu --quick` is a smoke test of the script itself on a machine without a GPU.
"""
from __future__ import annotations
import argparse, contextlib, os, random, sys, tempfile, time, traceback
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this clone's llm_engine, even without pip install -e
import torch

TEXTS = ["The capital of France is", "def fibonacci(n):",
         "<|im_start|>user\nWrite a haiku about paged memory.<|im_end|>\n<|im_start|>assistant\n", "1, 2, 3,"]

@dataclass
class Check:
    section: str
    status: str          # PASS, FAIL or SKIP
    detail: str

class Ctx:
    "What the sections share: arguments, device, model folder, prompts, and transformers' greedy tokens."
    def __init__(self, args):
        self.args, self.device, self.t0 = args, torch.device(args.device), time.time()
        self.model_path = self.prompts = self.hf_tokens = None
        self.random_weights = False
    def left(self) -> float: return self.args.budget - (time.time() - self.t0)
    def log(self, msg): print(f"[{time.time() - self.t0:6.1f}s] {msg}", flush=True)

def sync(dev):
    if dev.type == "cuda": torch.cuda.synchronize()

def free_memory(dev):
    import gc; gc.collect()
    if dev.type == "cuda": torch.cuda.empty_cache()

def has_device_field() -> bool:
    from llm_engine.config import EngineConfig
    return "device" in EngineConfig.__dataclass_fields__

# ---------------------------------------------------------------- the model to check
def random_smollm2(out: Path, layers=30) -> Path:
    "SmolLM2-135M's exact shape with random weights and a synthetic word-level tokenizer: for machines without the model."
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers
    if (out / "config.json").exists(): return out
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
                      num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
                      initializer_range=0.1, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(49152)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(out)
    return out

def resolve(ctx: Ctx):
    from llm_engine.model import resolve_model
    if ctx.args.model != "random":
        try:
            ctx.model_path = resolve_model(ctx.args.model)
        except (FileNotFoundError, ImportError, ValueError) as e:   # not installed, or gguf cannot convert it
            if ctx.args.model is not None: raise
            ctx.log(f"default model unavailable ({e}); using random weights of SmolLM2-135M's shape instead")
    if ctx.model_path is None:
        ctx.random_weights = True
        ctx.model_path = random_smollm2(Path(tempfile.gettempdir()) / "llm_engine_gpu_check_random_smollm2")
        rng = random.Random(0)
        ctx.prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (6, 5, 24, 7)]
    else:
        from llm_engine.model import load_tokenizer
        tok = load_tokenizer(ctx.model_path)
        ctx.prompts = [tok(t)["input_ids"] for t in TEXTS]

def load_hf(ctx: Ctx, dtype):
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(ctx.model_path, dtype=dtype).to(ctx.device).eval()
    hf.generation_config.eos_token_id = None      # always exactly max_new_tokens, like ignore_eos
    return hf

def hf_greedy(hf, prompt, n, dev):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt], device=dev), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()

# ---------------------------------------------------------------- our model, driven directly
def routed_attention():
    "Send the model's attention call to `cuda_paged_attention` (device-agnostic; knows the triton backend)."
    import llm_engine.model as M
    from unittest import mock
    from llm_engine.cuda import cuda_paged_attention
    if not hasattr(M, "paged_attention"): return contextlib.nullcontext()
    return mock.patch.object(M, "paged_attention", cuda_paged_attention)

def greedy_ours(model, prompts, n, dev, backend, block_size=16, graphs_max_batch=None):
    "One flat prefill of every prompt, then batched decode steps (through CUDA graphs when asked); tokens and first logits."
    from llm_engine.attention import AttentionMetadata
    from llm_engine.cuda import CUDAGraphRunner
    mc, dt = model.config, next(model.parameters()).dtype
    tables, nb = [], sum(-(-(len(p) + n) // block_size) for p in prompts) + 1   # + 1 spare block for graph padding
    perm = torch.randperm(nb - 1).tolist()                                       # blocks scattered over the pool
    tables = [[perm.pop() for _ in range(-(-(len(p) + n) // block_size))] for p in prompts]
    kv = torch.zeros(mc.num_layers, 2, nb, block_size, mc.num_kv_heads, mc.head_dim, dtype=dt, device=dev)
    caches = [(kv[i, 0], kv[i, 1]) for i in range(mc.num_layers)]
    graphs = None
    if graphs_max_batch:
        graphs = CUDAGraphRunner(model, caches, block_size, max(map(len, tables)), (nb - 1) * block_size, graphs_max_batch, backend)
        if dev.type == "cuda": graphs.capture()
    seqs = [list(p) for p in prompts]
    with torch.inference_mode():
        md = AttentionMetadata.build([len(p) for p in prompts], [len(p) for p in prompts], tables, block_size, device=dev, decode_backend=backend)
        ids = torch.tensor([t for p in prompts for t in p], device=dev)
        pos = torch.cat([torch.arange(len(p), device=dev) for p in prompts])
        last = torch.tensor([len(p) for p in prompts], device=dev).cumsum(0) - 1
        logits = first = model.compute_logits(model(ids, pos, md, caches)[last])
        for step in range(n):
            for s, t in zip(seqs, logits.argmax(-1).tolist()): s.append(t)
            if step == n - 1: break
            md = AttentionMetadata.build([1] * len(seqs), [len(s) for s in seqs], tables, block_size, device=dev, decode_backend=backend)
            ids, pos = torch.tensor([s[-1] for s in seqs], device=dev), torch.tensor([len(s) - 1 for s in seqs], device=dev)
            logits = graphs.run(ids, pos, md) if graphs else None
            if logits is None: logits = model.compute_logits(model(ids, pos, md, caches))
    return [s[len(p):] for s, p in zip(seqs, prompts)], first.float(), graphs

def first_divergence(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)

# ---------------------------------------------------------------- sections
def check_env(ctx: Ctx):
    from llm_engine.cuda import triton_available, flash_attn_varlen_func
    dev = ctx.device
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "none (CPU run)"
    import transformers
    tri = "absent"
    if triton_available():
        import triton; tri = triton.__version__
    ctx.log(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, triton {tri}, "
            f"flash-attn {'yes' if flash_attn_varlen_func else 'no'}, GPU: {gpu}")
    resolve(ctx)
    ctx.log(f"model: {ctx.model_path}{' (RANDOM weights, SmolLM2-135M shape)' if ctx.random_weights else ''}")
    engine = "EngineConfig.device present" if has_device_field() else "EngineConfig has no `device` field yet"
    return [Check("env", "PASS", f"{gpu}; triton {tri}; {engine}")]

def _decode_case(lens, dtype, seed, H=9, KVH=3, D=64, BS=16, NB=1024):
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(seed)
    kc, vc = torch.randn(NB, BS, KVH, D, generator=g), torch.randn(NB, BS, KVH, D, generator=g)
    perm = torch.randperm(NB, generator=g).tolist()
    width = max(-(-L // BS) for L in lens)
    bt = torch.tensor([[perm.pop() for _ in range(-(-L // BS))] + [0] * (width - -(-L // BS)) for L in lens])
    q = torch.randn(len(lens), H, D, generator=g)
    ref = torch.stack([F.scaled_dot_product_attention(q[b][None, :, None], kc[bt[b]].flatten(0, 1)[:L].transpose(0, 1)[None],
                       vc[bt[b]].flatten(0, 1)[:L].transpose(0, 1)[None], scale=D ** -0.5, enable_gqa=True)[0, :, 0]
                       for b, L in enumerate(lens)])
    return [x.to(dtype) for x in (q, kc, vc)] + [bt, torch.tensor(lens), ref]

def check_kernel(ctx: Ctx):
    from llm_engine.cuda import paged_decode_reference, paged_decode_triton, select_attention_backend
    dev, out = ctx.device, []
    backend = select_attention_backend(dev, torch.bfloat16)
    fns = {"reference": paged_decode_reference} | ({"triton": paged_decode_triton} if backend == "triton" else {})
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2)):
        worst = {k: 0.0 for k in fns}
        for seed in range(3):
            lens = [random.Random(seed * 100 + i).randint(1, 400) for i in range(33)]
            q, kc, vc, bt, ctx_lens, ref = _decode_case(lens, dtype, seed)
            q, kc, vc, bt, ctx_lens = (x.to(dev) for x in (q, kc, vc, bt, ctx_lens))
            for name, fn in fns.items():
                got = fn(torch.empty_like(q), q, kc, vc, bt, ctx_lens, 64 ** -0.5).float().cpu()
                worst[name] = max(worst[name], (got - ref).abs().max().item())
        for name, err in worst.items():
            out.append(Check("kernel", "PASS" if err < tol else "FAIL", f"{name} decode {str(dtype)[6:]}: max |err| vs dense SDPA {err:.2e} (tol {tol:.0e})"))
    if backend != "triton":
        out.append(Check("kernel", "SKIP" if dev.type != "cuda" else "FAIL", f"Triton decode not selected on {dev.type} (backend {backend!r})"))
    return out + _check_flat_prefill(dev)

def _check_flat_prefill(dev):
    from llm_engine.attention import AttentionMetadata, paged_attention
    from llm_engine.cuda import cuda_paged_attention
    g = torch.Generator().manual_seed(1)
    kc, vc, q = torch.randn(64, 16, 3, 64, generator=g), torch.randn(64, 16, 3, 64, generator=g), torch.randn(7 + 40 + 9, 9, 64, generator=g)
    spec = ([7, 40, 9], [7, 70, 9], [[5], [9, 1, 30, 2, 8], [11]])   # one prefill continues a 30-token cached prefix
    ref = paged_attention(q, kc, vc, AttentionMetadata.build(*spec, 16), 0.125)
    got = cuda_paged_attention(q.to(dev), kc.to(dev), vc.to(dev), AttentionMetadata.build(*spec, 16, device=dev), 0.125).cpu()
    err = (got - ref).abs().max().item()
    return [Check("kernel", "PASS" if err < 1e-4 else "FAIL", f"flat prefill (one SDPA call, cached prefix) vs notebook 03: max |err| {err:.2e}")]

def check_gpu_tests(ctx: Ctx):
    "The pytest tests marked `cuda` (Triton kernel, flat prefill, graph capture and replay on the GPU)."
    import subprocess
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "pytest", str(root / "tests" / "test_cuda.py"), "-m", "cuda", "-q", "-rs",
           "--noconftest", "-p", "no:cacheprovider", "-W", "ignore"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=max(60, min(240, ctx.left() - 60)), env=env, cwd=root)
    last = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
    if r.returncode == 0 and "passed" in last: return [Check("gpu_tests", "PASS", f"pytest -m cuda tests/test_cuda.py: {last}")]
    if r.returncode in (0, 5): return [Check("gpu_tests", "SKIP", f"pytest -m cuda: {last}")]
    print(r.stdout[-4000:], r.stderr[-2000:], file=sys.stderr)
    return [Check("gpu_tests", "FAIL", f"pytest -m cuda tests/test_cuda.py exited {r.returncode}: {last}")]

def check_parity(ctx: Ctx):
    from llm_engine.model import load_model
    from llm_engine.cuda import select_attention_backend
    dev, n, out = ctx.device, ctx.args.tokens, []
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False   # fp32 means fp32
    hf = load_hf(ctx, torch.float32)
    with torch.no_grad(): hf_logits = [hf(torch.tensor([p], device=dev)).logits[0, -1].float() for p in ctx.prompts]
    ctx.hf_tokens = [hf_greedy(hf, p, n, dev) for p in ctx.prompts]
    del hf; free_memory(dev)
    model = load_model(ctx.model_path, torch.float32)[0].to(dev)
    backends = dict.fromkeys([select_attention_backend(dev, torch.float32), "torch"])
    with routed_attention():
        for backend in backends:
            toks, first, _ = greedy_ours(model, ctx.prompts, n, dev, backend)
            diff = max((a - b).abs().max().item() for a, b in zip(first, hf_logits))
            if backend == next(iter(backends)):     # the prefill does not depend on the decode backend
                out.append(Check("parity", "PASS" if diff < ctx.args.logit_tol else "FAIL",
                                 f"fp32 last-token logits of {len(toks)} prompts prefilled together: max |diff| {diff:.2e} (tol {ctx.args.logit_tol:.0e})"))
            bad = [(i, first_divergence(a, b)) for i, (a, b) in enumerate(zip(toks, ctx.hf_tokens)) if a != b]
            out.append(Check("parity", "FAIL" if bad else "PASS", f"greedy {n} tokens, decode backend {backend!r}: "
                             + (f"differs from transformers (prompt, first position): {bad}" if bad else "identical to transformers")))
    del model; free_memory(dev)
    return out

def _ms_per_call(fn, dev, iters=30):
    fn(); sync(dev)
    t = time.perf_counter()
    for _ in range(iters): fn()
    sync(dev)
    return (time.perf_counter() - t) / iters * 1e3

def check_graphs(ctx: Ctx):
    from llm_engine.model import load_model
    dev, n = ctx.device, ctx.args.tokens
    if dev.type == "cuda":
        from llm_engine.cuda import triton_available
        if not triton_available(): return [Check("graphs", "SKIP", "CUDA graphs here need the Triton decode kernel, and Triton is absent")]
        backend = "triton"
    else: backend = "reference"     # no capture on the CPU: the same static-buffer forward, run eagerly
    if ctx.hf_tokens is None: return [Check("graphs", "SKIP", "no transformers tokens to compare with (parity section did not run)")]
    model = load_model(ctx.model_path, torch.float32)[0].to(dev)
    with routed_attention():   # 3 prompts: every decode step is padded to the graph of batch 4
        toks, _, graphs = greedy_ours(model, ctx.prompts[:3], n, dev, backend, graphs_max_batch=8)
    bad = [(i, first_divergence(a, b)) for i, (a, b) in enumerate(zip(toks, ctx.hf_tokens)) if a != b]
    what = f"captured sizes {sorted(graphs.graphs)}" if graphs.graphs else "not captured (CPU): static buffers run eagerly"
    out = [Check("graphs", "FAIL" if bad else "PASS", f"greedy {n} tokens through CUDAGraphRunner, 3 prompts padded to 4 ({what}), fp32: "
                 + (f"differs from transformers at {bad}" if bad else "identical to transformers"))]
    del model, graphs; free_memory(dev)
    if dev.type == "cuda": out.append(_graph_timing(ctx))
    return out

def _graph_timing(ctx: Ctx):
    "ms per decode step at batch 1 in bf16, eager vs replay (measured, printed, never asserted)."
    from llm_engine.attention import AttentionMetadata
    from llm_engine.cuda import CUDAGraphRunner
    from llm_engine.model import load_model
    dev = ctx.device
    model = load_model(ctx.model_path, torch.bfloat16)[0].to(dev)
    mc = model.config
    kv = torch.zeros(mc.num_layers, 2, 9, 16, mc.num_kv_heads, mc.head_dim, dtype=torch.bfloat16, device=dev)
    caches = [(kv[i, 0], kv[i, 1]) for i in range(mc.num_layers)]
    md = AttentionMetadata.build([1], [100], [list(range(7))], 16, device=dev, decode_backend="triton")
    ids, pos = torch.tensor([42], device=dev), torch.tensor([99], device=dev)
    with routed_attention(), torch.inference_mode():
        eager = _ms_per_call(lambda: model.compute_logits(model(ids, pos, md, caches)), dev)
        graphs = CUDAGraphRunner(model, caches, 16, 8, 8 * 16, max_batch=1, backend="triton").capture()
        replay = _ms_per_call(lambda: graphs.run(ids, pos, md), dev)
    del model, graphs; free_memory(dev)
    return Check("graphs", "PASS", f"batch-1 decode step, bf16: eager {eager:.2f} ms, graph replay {replay:.2f} ms ({eager / replay:.1f}x)")

def _engine_kwargs(ctx: Ctx):
    "LLM keyword arguments for the device, or a reason the engine checks cannot run."
    if has_device_field(): return {"device": ctx.args.device}, None
    if ctx.device.type == "cpu": return {}, None
    return None, "EngineConfig has no `device` field yet (the device-aware engine is not merged): engine checks need it"

def check_engine(ctx: Ctx):
    from llm_engine.engine import LLM
    from llm_engine.sampling import SamplingParams
    kw, why = _engine_kwargs(ctx)
    if why: return [Check("engine", "SKIP", why)]
    n = ctx.args.tokens
    llm = LLM(str(ctx.model_path), dtype="float32", **kw)
    where = next(llm.engine.model.parameters()).device.type
    backend = getattr(getattr(llm.engine, "runner", None), "attention_backend", "?")
    g = getattr(llm.engine.runner, "replayer", None)
    graphs = f"CUDA graphs {sorted(g.graphs)}" if g is not None else "no CUDA graphs"
    out = [Check("engine", "PASS" if where == ctx.device.type else "FAIL",
                 f"engine weights on {where} (asked: {ctx.device.type}); runner's decode backend: {backend!r}; {graphs}")]
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    free0 = llm.engine.block_manager.num_free_blocks
    together = [o.outputs[0].token_ids for o in llm.generate(ctx.prompts, sp, use_tqdm=False)]
    alone = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in ctx.prompts]
    bad_hf = [i for i, (a, b) in enumerate(zip(together, ctx.hf_tokens or together)) if list(a) != list(b)]
    bad_alone = [i for i, (a, b) in enumerate(zip(together, alone)) if list(a) != list(b)]
    out.append(Check("engine", "FAIL" if bad_hf else ("PASS" if ctx.hf_tokens else "SKIP"),
                     f"greedy {n} tokens via LLM, fp32: " + (f"prompts {bad_hf} differ from transformers" if bad_hf else "identical to transformers")))
    out.append(Check("engine", "FAIL" if bad_alone else "PASS", f"batch == alone for {len(alone)} prompts" + (f": differ {bad_alone}" if bad_alone else "")))
    free1 = llm.engine.block_manager.num_free_blocks
    out.append(Check("engine", "PASS" if free1 == free0 else "FAIL", f"free KV blocks after the runs: {free1} of {free0}"))
    del llm; free_memory(ctx.device)
    return out

def _graph_engines(ctx: Ctx, dtype: str, **kw):
    "Two engines on the device, graphs (or, on the CPU, the stand-in recorder) and enforce_eager; the graph runner."
    from llm_engine.engine import LLM
    from llm_engine.cuda import attach_cuda_graphs, record_eagerly
    base, why = _engine_kwargs(ctx)
    if why: return None, why
    from llm_engine.config import EngineConfig
    if "enforce_eager" not in EngineConfig.__dataclass_fields__: return None, "EngineConfig has no `enforce_eager` field (graphs not wired in)"
    opts = dict(dtype=dtype, **base, **kw)
    eager, graphed = LLM(str(ctx.model_path), enforce_eager=True, **opts), LLM(str(ctx.model_path), **opts)
    if ctx.device.type != "cuda":      # no graphs off CUDA: exercise the same plumbing with the stand-in recorder
        attach_cuda_graphs(graphed.engine.runner, graphed.engine.config.scheduler.max_num_seqs, graphed.engine.max_model_len,
                           recorder=record_eagerly, backend="reference")
    return (eager, graphed, graphed.engine.runner.replayer), None

def _ms_per_token(llm, prompts, n, dev) -> float:
    from llm_engine.sampling import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)   # warm-up
    sync(dev); t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    sync(dev)
    return (time.perf_counter() - t) * 1e3 / max(1, max(len(o.outputs[0].token_ids) for o in outs))

def check_engine_graphs(ctx: Ctx):
    from llm_engine.sampling import SamplingParams
    dev, n, out = ctx.device, ctx.args.tokens, []
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    for dtype in ("float32", "bfloat16") if dev.type == "cuda" else ("float32",):
        small = {} if dev.type == "cuda" else dict(max_num_seqs=4, kv_cache_memory="64MiB")   # the CPU stand-in is slow: keep it small
        got, why = _graph_engines(ctx, dtype, max_model_len=1024 if dev.type == "cuda" else 128, **small)
        if why: return [Check("engine_graphs", "SKIP", why)]
        eager, graphed, g = got
        if g is None:
            out.append(Check("engine_graphs", "FAIL" if dev.type == "cuda" else "SKIP", f"{dtype}: no graphs attached to the engine's runner"))
            continue
        a = [o.outputs[0].token_ids for o in eager.generate(ctx.prompts, sp, use_tqdm=False)]
        b = [o.outputs[0].token_ids for o in graphed.generate(ctx.prompts, sp, use_tqdm=False)]
        bad = [(i, first_divergence(x, y)) for i, (x, y) in enumerate(zip(a, b)) if list(x) != list(y)]
        kind = f"graphs {sorted(g.graphs)}" if dev.type == "cuda" else "stand-in recorder (CPU)"
        out.append(Check("engine_graphs", "FAIL" if bad or not g.counts["replay"] else "PASS",
                         f"{dtype} greedy {n} tokens, {kind} vs enforce_eager: " + (f"differ at {bad}" if bad else "identical")
                         + f"; decisions {dict(g.counts)}"))
        if dev.type == "cuda" and dtype == "bfloat16":
            rng = random.Random(1)
            for batch in (1, 8):
                ps = [[rng.randrange(3, 49000) for _ in range(16)] for _ in range(batch)]
                e_ms, g_ms = _ms_per_token(eager, ps, 128, dev), _ms_per_token(graphed, ps, 128, dev)
                out.append(Check("engine_graphs", "PASS", f"bf16 decode, batch {batch}, 128 tokens: eager {e_ms:.2f} ms/step, "
                                 f"graphs {g_ms:.2f} ms/step ({e_ms / g_ms:.1f}x; measured, not asserted)"))
        del eager, graphed, g; free_memory(dev)
    return out

def check_throughput(ctx: Ctx):
    from llm_engine.engine import LLM
    from llm_engine.sampling import SamplingParams
    kw, why = _engine_kwargs(ctx)
    if why: return [Check("throughput", "SKIP", why)]
    a, dev = ctx.args, ctx.device
    dtype = a.bench_dtype or ("bfloat16" if dev.type == "cuda" else "float32")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49000) for _ in range(rng.randint(20, 200))] for _ in range(a.requests)]
    llm = LLM(str(ctx.model_path), dtype=dtype, max_num_seqs=max(a.requests, 1), **kw)
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)   # warm-up
    sync(dev); t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    sync(dev); t_engine = time.perf_counter() - t
    n_engine = sum(len(o.outputs[0].token_ids) for o in outs)
    del llm; free_memory(dev)
    hf = load_hf(ctx, getattr(torch, dtype))
    hf_greedy(hf, prompts[0][:8], 4, dev)                                        # warm-up
    done, n_hf, t_hf = 0, 0, 0.0
    for p in prompts:                                                            # one request at a time
        if done and t_hf / done * 1.2 > ctx.left() - 20: break                   # stay inside the time budget
        t = time.perf_counter(); n_hf += len(hf_greedy(hf, p, a.max_tokens, dev)); sync(dev); t_hf += time.perf_counter() - t
        done += 1
    del hf; free_memory(dev)
    rows = [("llm_engine (continuous batching)", a.requests, n_engine, t_engine), ("transformers generate, one at a time", done, n_hf, t_hf)]
    print(f"\nThroughput on {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'CPU'}, {dtype}, "
          f"{a.max_tokens} new tokens per request, prompts of 20-200 tokens:")
    print(f"| system | requests | output tokens | seconds | tokens/s |\n|---|---|---|---|---|")
    for name, r, n, s in rows: print(f"| {name} | {r} | {n} | {s:.1f} | {n / s:.1f} |")
    speedup = (n_engine / t_engine) / (n_hf / t_hf)
    print(f"speedup: {speedup:.1f}x (the claim to check: about 15x){'' if done == a.requests else f'; transformers timed on {done} of {a.requests} requests'}\n")
    ok = n_engine == a.requests * a.max_tokens
    return [Check("throughput", "PASS" if ok else "FAIL", f"{speedup:.1f}x tokens/s over transformers one at a time ({dtype}, {a.requests} requests)"
                  + ("" if ok else f"; engine produced {n_engine} tokens, expected {a.requests * a.max_tokens}"))]

SECTIONS = {"env": check_env, "kernel": check_kernel, "gpu_tests": check_gpu_tests, "parity": check_parity, "graphs": check_graphs,
            "engine": check_engine, "engine_graphs": check_engine_graphs, "throughput": check_throughput}

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke test of this script)")
    p.add_argument("--model", default=None, help="model folder or .gguf; default: the embedded SmolLM2-135M; 'random': random weights of its shape")
    p.add_argument("--quick", action="store_true", help="small sizes: 8 greedy tokens, 4 requests of 16 tokens")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens compared with transformers")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request in the throughput run")
    p.add_argument("--bench-dtype", default=None, help="dtype of the throughput run (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--logit-tol", type=float, default=None, help="max |logit diff| vs transformers (default 1e-3 on cuda, 1e-4 on cpu)")
    p.add_argument("--budget", type=float, default=450, help="seconds; later sections are skipped once it is spent")
    p.add_argument("--only", nargs="*", choices=list(SECTIONS), help="run only these sections (env always runs)")
    a = p.parse_args(argv)
    if a.quick: a.tokens, a.requests, a.max_tokens = min(a.tokens, 8), min(a.requests, 4), min(a.max_tokens, 16)
    if a.logit_tol is None: a.logit_tol = 1e-3 if a.device.startswith("cuda") else 1e-4
    return a

def main(argv=None) -> int:
    a = parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu_check: --device {a.device} but torch {torch.__version__} sees no CUDA GPU "
              "(a CPU-only torch build, or no driver). Nothing checked.", file=sys.stderr)
        return 2
    ctx, results = Ctx(a), []
    for name, fn in SECTIONS.items():
        if name != "env" and a.only and name not in a.only: continue
        if ctx.left() < 15: results.append(Check(name, "SKIP", f"time budget of {a.budget:.0f}s spent")); continue
        ctx.log(f"== {name}")
        try: got = fn(ctx)
        except Exception as e:
            tb = traceback.format_exc().strip().splitlines()
            print("\n".join(tb[-12:]), file=sys.stderr)
            got = [Check(name, "FAIL", f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")]
            if name == "env": results += got; break
        for c in got: ctx.log(f"   {c.status:4}  {c.detail}")
        results += got
    print(f"\n===== gpu_check summary ({time.time() - ctx.t0:.0f}s, device {a.device}) =====")
    for c in results: print(f"{c.status:4}  {c.section:10}  {c.detail}")
    failed, skipped = [c for c in results if c.status == "FAIL"], [c for c in results if c.status == "SKIP"]
    print(f"\n{len(results) - len(failed) - len(skipped)} passed, {len(failed)} FAILED, {len(skipped)} skipped"
          + ("" if not skipped else " (skipped checks prove nothing: see their reasons)"))
    return 1 if failed else 0

if __name__ == "__main__": sys.exit(main())
