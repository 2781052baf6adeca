"The CUDA path (`llm_engine.cuda`): what runs on the CPU here, and the GPU checks, marked `cuda` and skipped without a GPU."
import os, random, subprocess, sys, tempfile
from pathlib import Path
from unittest import mock
import pytest
import torch
import torch.nn.functional as F
from llm_engine.attention import AttentionMetadata, paged_attention, store_kv, load_decode_kernel
from llm_engine.cuda import (CUDAGraphRunner, DecodeGraphBuffers, GraphDecision, attach_cuda_graphs, cuda_paged_attention,
                             graph_batch_sizes, graph_decision, padded_batch_size, paged_decode_reference, paged_decode_triton,
                             record_cuda_graph, record_eagerly, select_attention_backend, triton_available)

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_triton = pytest.mark.skipif(not triton_available(), reason="needs Triton (ships with CUDA builds of torch)")
def gpu_test(f): return pytest.mark.cuda(needs_gpu(f))

def decode_case(lens, H=8, KVH=2, D=16, BS=4, NB=128, dtype=torch.float32, seed=0, extra_cols=2):
    "Sequences of `lens` tokens in randomly ordered pool blocks: (q, k_cache, v_cache, tables, lens, dense SDPA answer)."
    g = torch.Generator().manual_seed(seed)
    kc, vc = torch.randn(NB, BS, KVH, D, generator=g), torch.randn(NB, BS, KVH, D, generator=g)
    perm = torch.randperm(NB, generator=g).tolist()
    width = max(-(-L // BS) for L in lens) + extra_cols
    tables = [[perm.pop() for _ in range(-(-L // BS))] for L in lens]
    bt = torch.tensor([t + [random.Random(i).randrange(NB) for i in range(width - len(t))] for t in tables])
    q = torch.randn(len(lens), H, D, generator=g)
    ref = torch.stack([F.scaled_dot_product_attention(
        q[b][None, :, None], kc[bt[b]].flatten(0, 1)[:L].transpose(0, 1)[None], vc[bt[b]].flatten(0, 1)[:L].transpose(0, 1)[None],
        scale=D ** -0.5, enable_gqa=True)[0, :, 0] for b, L in enumerate(lens)])
    return q.to(dtype), kc.to(dtype), vc.to(dtype), bt, torch.tensor(lens), ref

@pytest.mark.parametrize("H,KVH", [(8, 2), (9, 3), (4, 4), (6, 1)])
@pytest.mark.parametrize("seed", range(3))
def test_reference_matches_dense_attention(H, KVH, seed):
    rng = random.Random(seed)
    lens = [rng.randint(1, 45) for _ in range(rng.randint(1, 12))] + [4, 1]   # block-boundary and one-token rows
    q, kc, vc, bt, ctx, ref = decode_case(lens, H=H, KVH=KVH, seed=seed)
    out = paged_decode_reference(torch.empty_like(q), q, kc, vc, bt, ctx, 16 ** -0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

def test_reference_bf16_accumulates_in_fp32():
    q, kc, vc, bt, ctx, ref = decode_case([7, 19, 33], dtype=torch.bfloat16)
    out = paged_decode_reference(torch.empty_like(q), q, kc, vc, bt, ctx, 16 ** -0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=5e-2)

def test_entry_point_takes_bf16():
    "Flat prefill (one with a cached prefix) and reference decode in bf16 stay within bf16's resolution of fp32."
    g = torch.Generator().manual_seed(3)
    kc, vc, q = torch.randn(96, 4, 2, 16, generator=g), torch.randn(96, 4, 2, 16, generator=g), torch.randn(16, 8, 16, generator=g)
    spec = ([5, 9, 1, 1], [5, 14, 7, 20], [[0, 1], [2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12]])
    want = cuda_paged_attention(q, kc, vc, AttentionMetadata.build(*spec, 4, decode_backend="reference"), 0.25)
    got = cuda_paged_attention(q.bfloat16(), kc.bfloat16(), vc.bfloat16(), AttentionMetadata.build(*spec, 4, decode_backend="reference"), 0.25)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0, atol=5e-2)

def _mixed_step(prefill_specs, decode_lens, backend, H=8, KVH=2, D=16, BS=4, NB=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    kc, vc = torch.zeros(NB, BS, KVH, D), torch.zeros(NB, BS, KVH, D)
    perm = torch.randperm(NB, generator=g).tolist()
    specs = list(prefill_specs) + [(L - 1, 1) for L in decode_lens]
    tables = [[perm.pop() for _ in range(-(-(c + n) // BS))] for c, n in specs]
    for (c, n), t in zip(specs, tables):
        slots = AttentionMetadata.build([c + n], [c + n], [t], BS).slot_mapping
        store_kv(torch.randn(c + n, KVH, D, generator=g), torch.randn(c + n, KVH, D, generator=g), kc, vc, slots)
    build = lambda b: AttentionMetadata.build([n for _, n in specs], [c + n for c, n in specs], tables, BS, decode_backend=b)
    q = torch.randn(sum(n for _, n in specs), H, D, generator=g)
    return cuda_paged_attention(q, kc, vc, build(backend), D ** -0.5), paged_attention(q, kc, vc, build("torch"), D ** -0.5)

@pytest.mark.parametrize("backend", ["reference", "torch"] + ([] if load_decode_kernel() else ["cpp"]))
@pytest.mark.parametrize("case", [([(0, 7), (0, 13), (5, 6), (8, 3)], [1, 4, 9, 17, 30]), ([(0, 2)], []),
                                  ([], [5, 6, 7, 64]), ([(12, 9)], list(range(1, 40, 4)))])
def test_cuda_paged_attention_matches_notebook_03(backend, case):
    ours, theirs = _mixed_step(*case, backend)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)

def test_flat_prefill_mask_is_block_diagonal_and_causal():
    md = AttentionMetadata.build([3, 2], [3, 6], [[0], [1, 2]], 4)
    fp = md.flat_prefill()
    assert fp.mask.shape == (5, 9) and fp.cu_q.tolist() == [0, 3, 5] and fp.cu_k.tolist() == [0, 3, 9]
    assert fp.mask[:3, 3:].sum() == 0 and fp.mask[3:, :3].sum() == 0          # no attention across sequences
    assert fp.mask[3].tolist()[3:] == [True] * 5 + [False]                     # new token 5 of 6 sees the cached prefix
    assert fp.key_slots.tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 9]
    assert md.flat_prefill() is fp

def test_select_attention_backend():
    assert select_attention_backend("cuda", torch.bfloat16) == ("triton" if triton_available() else "torch")
    assert select_attention_backend("cuda:0", torch.float32, "torch") == "torch"
    assert select_attention_backend("mps", torch.float16) == "torch"
    assert select_attention_backend("cpu", torch.float32) == ("torch" if load_decode_kernel() else "cpp")
    assert select_attention_backend("cpu", torch.float32, "torch") == "torch"
    with pytest.raises(ValueError, match="needs a CUDA device"): select_attention_backend("cpu", requested="triton")
    with pytest.raises(ValueError, match="CPU kernel"): select_attention_backend("cuda", requested="cpp")
    with pytest.raises(ValueError, match="auto, triton, cpp or torch"): select_attention_backend("cuda", requested="flash")

def test_triton_wrapper_refuses_clearly_without_gpu():
    q, kc, vc, bt, ctx, _ = decode_case([3])
    with pytest.raises(RuntimeError, match="needs Triton" if not triton_available() else "CUDA tensors only"):
        paged_decode_triton(torch.empty_like(q), q, kc, vc, bt, ctx, 0.25)

def test_graph_batch_sizes_and_padding():
    assert graph_batch_sizes(32) == (1, 2, 4, 8, 16, 32)
    assert graph_batch_sizes(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert graph_batch_sizes(20) == (1, 2, 4, 8, 16, 20) and graph_batch_sizes(1) == (1,)
    sizes = graph_batch_sizes(32)
    assert [padded_batch_size(n, sizes) for n in (1, 3, 5, 9, 17, 32, 33)] == [1, 4, 8, 16, 32, 32, None]
    with pytest.raises(ValueError, match="max_batch"): graph_batch_sizes(0)

def test_buffers_fill_pads_into_the_spare_block():
    buf = DecodeGraphBuffers.allocate(8, 4, pad_slot=40, block_size=4)
    md = AttentionMetadata.build([1] * 3, [5, 2, 9], [[3, 1], [7], [0, 2, 6]], 4, decode_backend="reference")
    buf.fill(torch.tensor([11, 12, 13]), torch.tensor([4, 1, 8]), md, 4)
    assert buf.input_ids[:4].tolist() == [11, 12, 13, 0] and buf.positions[:4].tolist() == [4, 1, 8, 0]
    assert buf.context_lens[:4].tolist() == [5, 2, 9, 1]
    assert buf.slot_mapping[:4].tolist() == md.slot_mapping.tolist() + [40]
    assert buf.block_tables[:3, :3].tolist() == md.decode_block_tables.tolist() and buf.block_tables[3, 0] == 10
    smd = buf.metadata(4, "reference")
    assert smd.num_decodes == 4 and smd.decode_block_tables.data_ptr() == buf.block_tables.data_ptr()   # views, not copies

def _tiny_llama(layers=2, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    from llm_engine.model import load_model
    d = Path(tempfile.mkdtemp())
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)).save_pretrained(d)
    return load_model(d)[0]

def test_graph_runner_static_forward_equals_eager_on_cpu():
    "Everything but the recording: padded static buffers give the eager logits, and padding writes only the spare block."
    tiny, NB, BS = _tiny_llama(), 33, 4
    kv = torch.zeros(2, 2, NB, BS, 2, 16)
    caches = [(kv[i, 0], kv[i, 1]) for i in range(2)]
    perm, lens = torch.randperm(NB - 1).tolist(), [6, 12, 3, 9, 1]
    tables = [[perm.pop() for _ in range(-(-L // BS))] for L in lens]
    kv[:, :, :NB - 1].normal_()
    ids, pos = torch.randint(0, 256, (5,)), torch.tensor([L - 1 for L in lens])
    kv0 = kv.clone()
    with torch.inference_mode():
        eager = tiny.compute_logits(tiny(ids, pos, AttentionMetadata.build([1] * 5, lens, tables, BS, decode_backend="torch"), caches))
    kv_eager = kv.clone(); kv.copy_(kv0)
    graphs = CUDAGraphRunner(tiny, caches, BS, max_blocks=8, pad_slot=(NB - 1) * BS, max_batch=8, backend="reference")
    md = AttentionMetadata.build([1] * 5, lens, tables, BS, decode_backend="reference")
    got = graphs.run(ids, pos, md)      # the static metadata routes attention to cuda_paged_attention itself
    assert graphs.last == GraphDecision(True, 5, 8, "replay") and graphs.last.padding == 3 and got.shape == (5, 256)
    torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv[:, :, :NB - 1], kv_eager[:, :, :NB - 1], rtol=1e-5, atol=1e-5)
    assert not torch.equal(kv[:, :, NB - 1], kv0[:, :, NB - 1])                            # padding rows wrote here only
    pre = AttentionMetadata.build([3], [3], [[0]], BS, decode_backend="reference")
    assert graphs.run(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]), pre) is None      # prefill: eager
    with pytest.raises(RuntimeError, match="CUDA device"): graphs.capture()
    with pytest.raises(ValueError, match="CUDA graphs need a decode backend"):
        CUDAGraphRunner(tiny, caches, BS, 8, 0, backend="torch")

_INTERPRET = r'''
import random, torch, llm_engine.cuda as C
for lens, H, KVH, D, BS, dt in [([1, 15, 16, 17, 40, 100], 9, 3, 64, 16, torch.float32),
                                ([1, 4, 5, 6, 23], 8, 2, 48, 5, torch.float32), ([3, 33, 64], 9, 3, 64, 16, torch.bfloat16)]:
    g = torch.Generator().manual_seed(len(lens))
    kc, vc = (torch.randn(256, BS, KVH, D, generator=g).to(dt) for _ in range(2))
    perm = torch.randperm(256, generator=g).tolist()
    W = max(-(-L // BS) for L in lens) + 1
    bt = torch.tensor([[perm.pop() for _ in range(-(-L // BS))] + [0] * (W - -(-L // BS)) for L in lens])
    ctx, q = torch.tensor(lens), torch.randn(len(lens), H, D, generator=g).to(dt)
    out = torch.empty_like(q)
    C._paged_decode_kernel[(len(lens), H)](out, q, kc, vc, bt, ctx, D ** -0.5, BS, 0, 0.0, out.stride(0), out.stride(1), q.stride(0), q.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2), bt.stride(0),
        GROUP=H // KVH, BLOCK=C._next_pow2(BS), HEAD_DIM=D, D_PAD=C._next_pow2(D), WINDOW=False, SOFTCAP=False)
    ref = C.paged_decode_reference(torch.empty_like(q), q, kc, vc, bt, ctx, D ** -0.5)
    err = (out.float() - ref.float()).abs().max().item()
    assert err < (1e-5 if dt == torch.float32 else 3e-2), (lens, dt, err)
    wrapped = C.paged_decode_triton(torch.empty_like(q), q, kc, vc, bt, ctx, D ** -0.5)   # the public wrapper's launch
    assert (wrapped.float() - ref.float()).abs().max().item() < (1e-5 if dt == torch.float32 else 3e-2)
from llm_engine.attention import AttentionMetadata, paged_attention
g = torch.Generator().manual_seed(0)
kc, vc = torch.randn(64, 16, 3, 64, generator=g), torch.randn(64, 16, 3, 64, generator=g)
spec = ([7, 20, 1, 1, 1], [7, 50, 1, 17, 33], [[5], [9, 1, 30, 2], [11], [40, 41], [3, 60, 61]])   # 2 prefills, 3 decodes
q = torch.randn(30, 9, 64, generator=g)
ours = C.cuda_paged_attention(q, kc, vc, AttentionMetadata.build(*spec, 16, decode_backend="triton"), 0.125)
theirs = paged_attention(q, kc, vc, AttentionMetadata.build(*spec, 16, decode_backend="torch"), 0.125)
assert (ours - theirs).abs().max().item() < 1e-5
print("interpreted kernel == reference")
'''

@needs_triton
def test_triton_kernel_in_interpreter_matches_reference():
    "Triton's interpreter runs the real kernel body on the CPU (the environment variable must be set before the kernel is defined)."
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", _INTERPRET], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "interpreted kernel == reference" in r.stdout

@needs_triton
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("window_cap", [False, True])
def test_triton_kernel_compiles_for_hopper(dtype, window_cap):
    "Ahead-of-time compilation for sm_90 (an H100/H200) needs no GPU: it catches type errors the interpreter does not."
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from llm_engine.cuda import _paged_decode_kernel
    strides = ["s_ob", "s_oh", "s_qb", "s_qh", "s_kb", "s_kt", "s_kh", "s_vb", "s_vt", "s_vh", "s_bt"]
    sig = {"out_ptr": f"*{dtype}", "q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "bt_ptr": "*i64", "cl_ptr": "*i64",
           "scale": "fp32", "block_size": "i32", "window": "i32", "softcap": "fp32", **{s: "i64" for s in strides},
           "GROUP": "constexpr", "BLOCK": "constexpr", "HEAD_DIM": "constexpr", "D_PAD": "constexpr", "WINDOW": "constexpr", "SOFTCAP": "constexpr"}
    src = ASTSource(fn=_paged_decode_kernel, signature=sig, constexprs={"GROUP": 3, "BLOCK": 16, "HEAD_DIM": 64, "D_PAD": 64,
                                                                        "WINDOW": window_cap, "SOFTCAP": window_cap})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 2})
    assert len(compiled.asm["cubin"]) > 1000

@gpu_test
@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_triton_kernel_on_gpu(dtype, tol):
    for seed in range(4):
        lens = [random.Random(seed * 10 + i).randint(1, 300) for i in range(17)]
        q, kc, vc, bt, ctx, ref = decode_case(lens, H=9, KVH=3, D=64, BS=16, NB=512, dtype=dtype, seed=seed)
        q, kc, vc, bt, ctx = (x.cuda() for x in (q, kc, vc, bt, ctx))
        got = paged_decode_triton(torch.empty_like(q), q, kc, vc, bt, ctx, 64 ** -0.5)
        torch.testing.assert_close(got.float().cpu(), ref, rtol=0, atol=tol)

@gpu_test
def test_flat_prefill_on_gpu_matches_cpu():
    ours, theirs = _mixed_step([(0, 7), (0, 13), (5, 6)], [], "torch")
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(32, 4, 2, 16, generator=g).cuda(), torch.randn(32, 4, 2, 16, generator=g).cuda()
    md = AttentionMetadata.build([7, 5], [7, 9], [[3, 1], [0, 2, 5]], 4, device="cuda")
    q = torch.randn(12, 8, 16, generator=g).cuda()
    cpu_md = AttentionMetadata.build([7, 5], [7, 9], [[3, 1], [0, 2, 5]], 4)
    torch.testing.assert_close(cuda_paged_attention(q, kc, vc, md, 0.25).cpu(), cuda_paged_attention(q.cpu(), kc.cpu(), vc.cpu(), cpu_md, 0.25),
                               rtol=1e-4, atol=1e-4)

@gpu_test
@needs_triton
def test_graph_capture_and_replay_equal_eager():
    dev, BS, NB = torch.device("cuda"), 4, 129   # 128 blocks: room for 8 sequences of up to 60 tokens
    tiny = _tiny_llama(seed=1).to(dev)
    kv = torch.zeros(2, 2, NB, BS, 2, 16, device=dev)
    caches = [(kv[i, 0], kv[i, 1]) for i in range(2)]
    graphs = CUDAGraphRunner(tiny, caches, BS, max_blocks=16, pad_slot=(NB - 1) * BS, max_batch=8, backend="triton").capture()
    assert sorted(graphs.graphs) == [1, 2, 4, 8]
    for trial, n in enumerate((1, 3, 8, 5)):
        lens = [random.Random(trial * 10 + i).randint(1, 60) for i in range(n)]
        perm = torch.randperm(NB - 1).tolist()
        md = AttentionMetadata.build([1] * n, lens, [[perm.pop() for _ in range(-(-L // BS))] for L in lens], BS,
                                     device=dev, decode_backend="triton", attention=cuda_paged_attention)
        ids, pos = torch.randint(0, 256, (n,), device=dev), torch.tensor([L - 1 for L in lens], device=dev)
        kv.normal_(); saved = kv.clone()
        got = graphs.run(ids, pos, md).clone()
        kv.copy_(saved)
        with torch.inference_mode(): want = tiny.compute_logits(tiny(ids, pos, md, caches))
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    assert graphs.counts["replay"] == 4

def test_runner_hands_attention_to_the_cuda_path_through_the_metadata():
    "The runner's `attention_fn` (set on a GPU) reaches `paged_attention` via `AttentionMetadata.attention`; on CPU with the reference kernel the logits equal the CPU path's."
    import tempfile
    from llm_engine.testing import make_tiny_model
    from llm_engine.model import load_model
    from llm_engine.runner import ModelRunner
    from llm_engine.cuda import cuda_paged_attention
    m, _ = load_model(make_tiny_model(tempfile.mkdtemp()))
    work = [([5, 6, 7, 8, 9], 0, [0]), ([3, 4], 0, [1])]
    base = ModelRunner(m, 8, 8, attention_backend="torch")
    ref = base.run(work)
    r = ModelRunner(m, 8, 8, attention_backend="torch")
    calls = []
    def spy(*a): calls.append(a[3].decode_backend); return cuda_paged_attention(*a)
    r.attention_fn, r.attention_backend = spy, "reference"
    torch.testing.assert_close(r.run(work), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r.run([([10], 5, [0]), ([11], 2, [1])]), base.run([([10], 5, [0]), ([11], 2, [1])]), atol=1e-5, rtol=1e-5)
    assert calls and set(calls) == {"reference"}


# --- CUDA graphs wired into the runner and the engine: the dispatch decision, the stand-in recorder, enforce_eager ---

@pytest.mark.parametrize("step,reason,size", [
    ((0, 1, 1, False), "replay", 1), ((0, 3, 2, False), "replay", 4), ((0, 17, 3, False), "replay", 32),
    ((0, 32, 3, False), "replay", 32), ((1, 0, 1, False), "multi_token_rows", None), ((2, 5, 4, False), "multi_token_rows", None),
    ((0, 4, 2, True), "all_logits", None), ((0, 33, 2, False), "batch_too_large", None),
    ((0, 2, 9, False), "table_too_wide", None), ((0, 0, 0, False), "empty", None)])
def test_graph_decision_names_each_step(step, reason, size):
    p, n, w, al = step
    d = graph_decision(p, n, w, graph_batch_sizes(32), 8, all_logits=al)
    assert (d.replay, d.reason, d.graph_size) == (reason == "replay", reason, size)
    assert d.padding == (size - n if size else 0)

def test_enforce_eager_and_cpu_record_nothing():
    tiny = _tiny_llama()
    kv = torch.zeros(2, 2, 9, 4, 2, 16)
    caches = [(kv[i, 0], kv[i, 1]) for i in range(2)]
    g = CUDAGraphRunner(tiny, caches, 4, 4, 32, max_batch=4, backend="reference", enforce_eager=True, recorder=record_eagerly).capture()
    assert g.graphs == {} and graph_decision(0, 1, 1, g.sizes, 4, enforce_eager=True).reason == "enforce_eager"
    with pytest.raises(RuntimeError, match="CUDA device"):      # the real recorder refuses a CPU model
        CUDAGraphRunner(tiny, caches, 4, 4, 32, max_batch=4, backend="reference").capture()
    from llm_engine.runner import ModelRunner
    r = ModelRunner(tiny, 8, 4)
    assert attach_cuda_graphs(r, 4, 64) is None and r.replayer is None                     # CPU: graphs are CUDA only
    assert attach_cuda_graphs(r, 4, 64, enforce_eager=True, recorder=record_eagerly, backend="reference") is None
    with pytest.warns(UserWarning, match="cannot be recorded"):                               # a host-synchronising backend
        assert attach_cuda_graphs(r, 4, 64, recorder=record_eagerly, backend="torch") is None
    assert r.replayer is None and r.kv_cache.shape[2] == 9 and r.scratch_slot == 32

def test_stand_in_replays_read_the_static_buffers():
    "Record once (stand-in), then replay batches that differ in tokens, lengths and blocks: each equals the eager forward."
    tiny, NB, BS = _tiny_llama(seed=2), 65, 4
    kv = torch.zeros(2, 2, NB, BS, 2, 16)
    caches = [(kv[i, 0], kv[i, 1]) for i in range(2)]
    g = CUDAGraphRunner(tiny, caches, BS, max_blocks=8, pad_slot=(NB - 1) * BS, max_batch=8, backend="reference",
                        recorder=record_eagerly).capture()
    assert sorted(g.graphs) == [1, 2, 4, 8]
    kv[:, :, :NB - 1].normal_(); kv0 = kv.clone()
    for trial, n in enumerate((5, 8, 1, 3, 2)):
        lens = [random.Random(trial * 31 + i).randint(1, 32) for i in range(n)]
        perm = torch.randperm(NB - 1).tolist()
        tables = [[perm.pop() for _ in range(-(-L // BS))] for L in lens]
        ids, pos = torch.randint(0, 256, (n,)), torch.tensor([L - 1 for L in lens])
        kv.copy_(kv0)
        got = g.run(ids, pos, AttentionMetadata.build([1] * n, lens, tables, BS, decode_backend="reference")).clone()
        assert g.last.graph_size == padded_batch_size(n, g.sizes)
        kv.copy_(kv0)
        with torch.inference_mode():
            want = tiny.compute_logits(tiny(ids, pos, AttentionMetadata.build([1] * n, lens, tables, BS, decode_backend="torch"), caches))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert g.counts == {"replay": 5}

def _tiny_engines(**kw):
    from llm_engine.engine import LLM
    from llm_engine.testing import make_tiny_model
    d = str(make_tiny_model(tempfile.mkdtemp()))
    opts = dict(device="cpu", dtype="float32", max_num_seqs=8, max_model_len=128, block_size=4, kv_cache_memory="4MiB", **kw)   # fp32: the exact path; "auto" picks bf16 on AVX512_BF16 machines, where near-ties flip
    eager, graphed = LLM(d, **opts), LLM(d, **opts)
    g = attach_cuda_graphs(graphed.engine.runner, 8, graphed.engine.max_model_len, recorder=record_eagerly, backend="reference")
    return eager, graphed, g

def test_engine_greedy_with_stand_in_graphs_equals_eager():
    from llm_engine.sampling import SamplingParams
    eager, graphed, g = _tiny_engines()
    assert eager.engine.runner.replayer is None and graphed.engine.runner.replayer is g
    prompts = [random.Random(i).sample(range(100, 5000), n) for i, n in enumerate((3, 9, 5, 14, 2, 7))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)] == want
    assert g.counts["replay"] >= 11 and g.counts["multi_token_rows"] >= 1
    # prompt logprobs: the prefill rows want every position's logits and run eagerly; the values match the eager engine's
    lp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=1, logprobs=2)
    a, b = eager.generate(prompts[:2], lp, use_tqdm=False), graphed.generate(prompts[:2], lp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    for x, y in zip(a, b):
        for p, q in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]): assert p.keys() == q.keys()
    bm = graphed.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks

def test_spec_decode_verify_steps_run_eagerly_beside_graphs():
    "Speculative decoding: verify rows (k+1 tokens) are multi-token rows and run eagerly; greedy output is unchanged."
    from llm_engine.sampling import SamplingParams
    eager, graphed, g = _tiny_engines(num_speculative_tokens=3, prompt_lookup_min=1)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    firsts = [random.Random(i).sample(range(100, 5000), n) for i, n in enumerate((6, 4, 9))]
    conts = [o.outputs[0].token_ids for o in eager.generate(firsts, params, use_tqdm=False)]
    prompts = [p + list(c) for p, c in zip(firsts, conts)]   # tokens this model likes to emit: a repeat proposes drafts
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    before = dict(g.counts)
    assert [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)] == want
    assert graphed.engine.speculator.num_drafts > 0
    assert g.counts["multi_token_rows"] - before.get("multi_token_rows", 0) >= 2   # the prefill, then verify steps

@gpu_test
@needs_triton
def test_engine_graphs_equal_enforce_eager_on_gpu():
    from llm_engine.engine import LLM
    from llm_engine.sampling import SamplingParams
    from llm_engine.testing import make_tiny_model
    d = str(make_tiny_model(tempfile.mkdtemp()))
    prompts = [random.Random(i).sample(range(100, 5000), n) for i, n in enumerate((3, 9, 5, 14, 2, 7))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = {}
    for eager in (True, False):
        llm = LLM(d, device="cuda", enforce_eager=eager, max_model_len=256)
        assert (llm.engine.runner.replayer is None) == eager
        runs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if not eager: assert llm.engine.runner.replayer.counts["replay"] > 0
    assert runs[True] == runs[False]
