"A model whose every layer has a sliding window (tiny Mistral, window 8) frees the blocks behind it while sequences run: block accounting and greedy ids against transformers."
import math
import pytest, torch
from llm_engine.testing import make_tiny_family
from llm_engine.engine import LLM
from llm_engine.sampling import SamplingParams
from llm_engine.model import load_tokenizer

WINDOW, BS, NEW = 8, 4, 40
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    return", "Once upon a time, in a land far away, there lived a"]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)

@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    d = make_tiny_family(tmp_path_factory.mktemp("swa") / "mistral", "mistral", sliding_window=WINDOW)
    ids = [load_tokenizer(d)(p)["input_ids"] for p in PROMPTS]
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    want = [hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            for p in ids]
    assert len(set(map(tuple, want))) == 3 and max(len(set(w)) for w in want) > 4    # not a degenerate model
    return d, ids, want

def watched(llm):
    "Record, after every step, the most live blocks a sequence past its prompt holds and how many blocks were freed behind windows."
    sch, bm, seen = llm.engine.scheduler, llm.engine.block_manager, dict(peak=0, freed=0)
    update, free_out = sch.update, bm.free_outside_window
    def counting(seq_id, num_computed):
        n = free_out(seq_id, num_computed); seen["freed"] += n; return n
    def update_and_look(out):
        r = update(out)
        for s in sch.running:
            if s.num_computed > s.num_prompt_tokens: seen["peak"] = max(seen["peak"], len(bm.tables[s.seq_id]))
        bm.check_invariants()
        return r
    sch.update, bm.free_outside_window = update_and_look, counting
    return seen

def ours(llm, ids): return [o.outputs[0].token_ids for o in llm.generate(ids, GREEDY, use_tqdm=False)]

@pytest.mark.parametrize("caching,backend", [(True, "auto"), (False, "auto"), (True, "torch")])
def test_window_frees_blocks_and_matches_transformers(mistral, caching, backend):
    "The C++ decode kernel and the torch path (which gathers the placeholders, block 0, and masks them) both give transformers' ids."
    d, ids, want = mistral
    llm = LLM(model=str(d), dtype="float32", block_size=BS, enable_prefix_caching=caching, attention_backend=backend)
    bm = llm.engine.block_manager
    assert bm.sliding_window == WINDOW
    seen = watched(llm)
    assert ours(llm, ids) == want                             # batched
    assert [ours(llm, [p])[0] for p in ids] == want           # alone
    assert seen["freed"] > 0 and 0 < seen["peak"] <= math.ceil(WINDOW / BS) + 2, seen
    assert bm.num_free_blocks == bm.num_blocks and not bm.tables and not bm.dropped

@pytest.mark.parametrize("swap_space", [0, 2**20])
def test_preemption_with_freed_blocks(mistral, swap_space):
    "14 blocks of 4 tokens: one sequence (about 55 tokens) fits, six at once hold about 4 each and preempt (by recompute, or by swap of their live blocks only), and still match."
    d, ids, want = mistral
    llm = LLM(model=str(d), dtype="float32", block_size=BS, num_blocks=14, swap_space=swap_space)
    seen = watched(llm)
    assert ours(llm, ids + ids) == want + want
    sch, bm = llm.engine.scheduler, llm.engine.block_manager
    assert sch.num_preemptions > 0 and (sch.num_swaps > 0) == bool(swap_space), (sch.num_preemptions, sch.num_swaps)
    assert seen["freed"] > 0 and bm.num_free_blocks == bm.num_blocks and not bm.cpu_tables and len(bm.cpu_free) == bm.num_cpu_blocks

def test_gemma_frees_nothing(tmp_path):
    "A model with global layers beside its windowed ones (Gemma 2) reads every key again: no block is freed early."
    from llm_engine.block_manager import freeable_window
    from llm_engine.model import load_model
    d = make_tiny_family(tmp_path / "gemma2", "gemma2")
    mc = load_model(str(d), torch.float32, "cpu")[0].config
    assert mc.sliding_window and any(mc.layer_window(i) is None for i in range(mc.num_layers))
    assert freeable_window(mc) is None

def test_forked_samples_equal_an_engine_that_frees_nothing(mistral):
    "n=2 seeded sampling forks sequences that share the parent's blocks and placeholders: the same tokens as with freeing off."
    d, ids, _ = mistral
    sp = SamplingParams(temperature=0.8, max_tokens=NEW, n=2, seed=3, ignore_eos=True)
    runs = []
    for free in (True, False):
        llm = LLM(model=str(d), dtype="float32", block_size=BS, seed=0)
        if not free: llm.engine.block_manager.sliding_window = None
        seen = watched(llm)
        runs.append([[c.token_ids for c in o.outputs] for o in llm.generate(ids, sp, use_tqdm=False)])
        assert (seen["freed"] > 0) == free and llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    assert runs[0] == runs[1] and all(a != b for a, b in runs[0])

def test_long_prompt_prefills_in_window_sized_pieces(mistral):
    "A 60-odd token prompt prefilled 8 tokens a step holds at most one chunk's blocks plus the window's (5 of 4 tokens), never its whole length; same ids as transformers."
    from transformers import AutoModelForCausalLM
    d, ids, _ = mistral
    long = (ids[0] + ids[1] + ids[2]) * 2
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    want = hf.generate(torch.tensor([long]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(long):].tolist()
    llm = LLM(model=str(d), dtype="float32", block_size=BS, max_num_batched_tokens=8)
    sch, bm, peak = llm.engine.scheduler, llm.engine.block_manager, [0]
    schedule = sch.schedule
    def look():
        out = schedule()
        peak[0] = max([peak[0]] + [len(bm.tables[r.seq_id]) for r in out.scheduled])
        return out
    sch.schedule = look
    got = llm.generate([long], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    assert len(long) > 50 and 0 < peak[0] <= bm.admit_need(len(long), 8) == 5, peak
    assert bm.num_free_blocks == bm.num_blocks

def test_request_longer_than_the_pool_is_admitted(mistral):
    "8 blocks of 4 tokens hold 32 tokens; a windowed request of about 60 (its prompt and 40 new tokens) never holds more than its window's blocks and a chunk's, so it is admitted, runs and matches."
    d, ids, want = mistral
    llm = LLM(model=str(d), dtype="float32", block_size=BS, num_blocks=8, swap_space=0, max_num_batched_tokens=8)
    bm = llm.engine.block_manager
    assert len(ids[2]) + NEW > bm.num_blocks * BS
    assert ours(llm, [ids[2]]) == [want[2]]
    assert bm.num_free_blocks == bm.num_blocks and not bm.tables
    # a model without a window is still refused such a request, with the message naming the cache
    from llm_engine.testing import make_tiny_model
    plain = LLM(model=str(make_tiny_model(d.parent / "plain")), dtype="float32", block_size=BS, num_blocks=8, swap_space=0)
    with pytest.raises(ValueError, match="KV cache"): plain.generate([ids[2]], GREEDY, use_tqdm=False)
