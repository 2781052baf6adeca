"""Sliding window and soft-capped scores in the paged decode paths of chapter 11a (issue #24): the torch reference and the
entry point everywhere; the Triton kernel where Triton imports (on a GPU, else in Triton's interpreter on the CPU)."""
import os, random, subprocess, sys
from dataclasses import replace
from pathlib import Path
import pytest
import torch
from llm_engine.attention import AttentionMetadata, load_decode_kernel
from llm_engine.cuda import cuda_paged_attention, paged_decode_reference
from llm_engine.model import window_attention, window_decode

BS, H, KVH, D = 16, 8, 2, 32
LENS = [1, 5, 16, 17, 40, 64, 100]      # one block, a block's edge, just past it, several blocks, in one batch
# 7 and 24 start inside a block for most rows (24: on the edge for L=40), 36: on the edge for L=100 and before the
# first key for L <= 36, 200: before every row's first key (the whole context)
WINDOWS = [0, 1, 7, 24, 36, 200]
CAPS = [0.0, 2.0]
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}     # bf16: one rounding of outputs up to 4 in size
HAVE_CPP = load_decode_kernel() is None

def decode_case(lens, dtype=torch.float32, seed=0, NB=96):
    "Rows of `lens` tokens in randomly ordered blocks of a pool (table padding points anywhere): tensors and decode metadata."
    g = torch.Generator().manual_seed(seed)
    kc, vc = (torch.randn(NB, BS, KVH, D, generator=g).to(dtype) for _ in range(2))
    perm = torch.randperm(NB, generator=g).tolist()
    W = max(-(-L // BS) for L in lens) + 2
    bt = torch.tensor([[perm.pop() for _ in range(-(-L // BS))] + [random.Random(L).randrange(NB) for _ in range(W - -(-L // BS))]
                       for L in lens])
    ctx, q = torch.tensor(lens), torch.randn(len(lens), H, D, generator=g).to(dtype)
    md = AttentionMetadata(torch.zeros(len(lens), dtype=torch.long), BS, decode_block_tables=bt, decode_context_lens=ctx)
    return q, kc, vc, bt, ctx, md

def notebook_05(q, kc, vc, md, window, softcap, scale=D ** -0.5):
    want = torch.empty_like(q)
    window_decode(want, q, kc, vc, md, scale, window, softcap)
    return want

def max_errors(fn, dtype, seed=0, device="cpu"):
    "Max abs error of `fn` (the C++ op's signature) against notebook 05's `window_decode`, per (window, cap)."
    q, kc, vc, bt, ctx, md = decode_case(LENS, dtype, seed)
    errs = {}
    for window in WINDOWS:
        for softcap in CAPS:
            args = [x.to(device) for x in (q, kc, vc, bt, ctx)]
            got = fn(torch.empty_like(args[0]), *args, D ** -0.5, window, softcap)
            errs[window, softcap] = (got.float().cpu() - notebook_05(q, kc, vc, md, window, softcap).float()).abs().max().item()
    return errs

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(2))
def test_reference_matches_window_decode(dtype, seed):
    errs = max_errors(paged_decode_reference, dtype, seed)
    assert max(errs.values()) < TOL[dtype], errs

@pytest.mark.skipif(not HAVE_CPP, reason=f"the C++ kernel did not build here: {load_decode_kernel()}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_op_matches_window_decode(dtype):
    errs = max_errors(lambda out, *a: torch.ops.llm_engine.paged_decode(out, *a) or out, dtype)
    assert max(errs.values()) < TOL[dtype], errs

def test_window_and_cap_change_the_answer_where_they_should():
    q, kc, vc, bt, ctx, _ = decode_case(LENS)
    run = lambda w, c: paged_decode_reference(torch.empty_like(q), q, kc, vc, bt, ctx, D ** -0.5, w, c)
    full = run(0, 0.0)
    assert (run(24, 0.0)[4:] - full[4:]).abs().amax(dim=(1, 2)).min() > 1e-3     # rows of 40, 64, 100 tokens: fewer keys
    torch.testing.assert_close(run(24, 0.0)[:4], full[:4])                      # rows of at most 24 tokens: all of them
    torch.testing.assert_close(run(200, 0.0), full)
    assert (run(0, 2.0) - full).abs().max() > 1e-3
    last_v = torch.stack([vc[bt[b, (L - 1) // BS], (L - 1) % BS].repeat_interleave(H // KVH, 0) for b, L in enumerate(LENS)])
    torch.testing.assert_close(run(1, 0.0), last_v)                             # window 1: the row's own value
    with pytest.raises(ValueError, match="0 \\(none\\) or positive"): run(-1, 0.0)
    with pytest.raises(ValueError, match="0 \\(none\\) or positive"): run(0, -1.0)

def test_huge_scores_with_a_cap_stay_finite():
    q, kc, vc, bt, ctx, md = decode_case([1, 17, 100])
    got = paged_decode_reference(torch.empty_like(q), q * 1e4, kc, vc, bt, ctx, 1.0, 24, 30.0)
    torch.testing.assert_close(got, notebook_05(q * 1e4, kc, vc, md, 24, 30.0, scale=1.0))

def window_step(backend, dtype, seed=0):
    "2 prefills (one a 9-token chunk after a 40-token prefix) and 4 decodes in a scattered pool, with `md.attention` set."
    g = torch.Generator().manual_seed(seed)
    kc, vc = (torch.randn(64, BS, KVH, D, generator=g).to(dtype) for _ in range(2))
    qlens, clens = [23, 9, 1, 1, 1, 1], [23, 49, 5, 17, 40, 100]
    perm = torch.randperm(64, generator=g).tolist()
    tables = [[perm.pop() for _ in range(-(-c // BS))] for c in clens]
    md = AttentionMetadata.build(qlens, clens, tables, BS, decode_backend=backend, attention=cuda_paged_attention)
    return torch.randn(sum(qlens), H, D, generator=g).to(dtype), kc, vc, md

@pytest.mark.parametrize("backend", ["reference", "torch"] + (["cpp"] if HAVE_CPP else []))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (7, 0.0), (16, 2.0), (24, 0.0), (0, 2.0), (200, 2.0)])
def test_window_attention_through_cuda_paged_attention(backend, dtype, window, softcap):
    "notebook 05's `window_attention` handing the step to `cuda_paged_attention` equals its own torch path."
    q, kc, vc, md = window_step(backend, dtype)
    ours = window_attention(q, kc, vc, md, D ** -0.5, window, softcap)
    theirs = window_attention(q, kc, vc, replace(md, attention=None), D ** -0.5, window, softcap)
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=0, atol=TOL[dtype])

def _triton_here():
    "Where the kernel can run in this process: a CUDA GPU, or the CPU under the interpreter; `None`: neither."
    if os.environ.get("TRITON_INTERPRET") == "1": return "cpu"
    return "cuda" if torch.cuda.is_available() else None

def _rerun_in_interpreter(test_id: str):
    "Run one test of this file again in a child with Triton's interpreter on (it must be set before the kernel is defined)."
    root = str(Path(__file__).parents[1])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::{test_id}"],
                       env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert r.returncode == 0 and " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]

def test_triton_kernel_window_and_cap():
    "The Triton kernel against `window_decode`: every window and cap, fp32 and bf16."
    pytest.importorskip("triton", reason="the Triton kernel needs Triton (it ships with CUDA builds of torch)")
    device = _triton_here()
    if device is None: return _rerun_in_interpreter("test_triton_kernel_window_and_cap")
    from llm_engine.cuda import paged_decode_triton
    for dtype in (torch.float32, torch.bfloat16):
        errs = max_errors(paged_decode_triton, dtype, device=device)
        assert max(errs.values()) < TOL[dtype], (dtype, errs)
        print(f"triton ({device}) {dtype}: max abs error {max(errs.values()):.1e}")

def test_triton_kernel_skips_blocks_before_the_window():
    "Table entries of blocks wholly before a row's window point past the pool: the kernel must not read them, nor the blocks."
    pytest.importorskip("triton", reason="the Triton kernel needs Triton (it ships with CUDA builds of torch)")
    device = _triton_here()
    if device is None: return _rerun_in_interpreter("test_triton_kernel_skips_blocks_before_the_window")
    from llm_engine.cuda import paged_decode_triton
    q, kc, vc, bt, ctx, md = decode_case(LENS)
    window = 20
    want = notebook_05(q, kc, vc, md, window, 2.0)
    poisoned = bt.clone()
    for b, L in enumerate(LENS):
        poisoned[b, : max(0, L - window) // BS] = 10 ** 12     # the 100-token row reads blocks 5 and 6 only: ceil(20/16) + 1
    kc, vc = kc.clone(), vc.clone()
    for b, L in enumerate(LENS): kc[bt[b, : max(0, L - window) // BS]] = vc[bt[b, : max(0, L - window) // BS]] = float("nan")
    got = paged_decode_triton(*(x.to(device) for x in (torch.empty_like(q), q, kc, vc, poisoned, ctx)), D ** -0.5, window, 2.0)
    # what this test is for: a read of a poisoned block gives NaN or an error of order 1 (precision is the test above's).
    # At fp32's default tolerance one run in several failed: Triton's interpreter, 127 of 1,792 values off by up to 4.2e-5
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
