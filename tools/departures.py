"""Greedy first departures from fp32: 8 short prompts in one batch, 24 tokens each, per precision named on the command line
(`python tools/departures.py w8a8 int8 q4`); 24 means the continuation matched fp32's to the end."""
import sys
from llm_engine.engine import LLM
from llm_engine.sampling import SamplingParams
from llm_engine.config import CPU_ISA
prompts = ["Write a haiku about the sea.", "Explain how a hash table works.", "What is the capital of France? Answer briefly.",
           "List three uses of copper.", "Tell me a short story about a robot who learns to paint.", "How do vaccines work?",
           "Give me a recipe for pancakes.", "Why is the sky blue?"]
sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
def run(**kw):
    llm = LLM(num_threads=2, **kw)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
ref = run(dtype="float32")
for q in sys.argv[1:]:
    got = run(quantization=q)
    first = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), sp.max_tokens) for r, g in zip(ref, got)]
    print(CPU_ISA.name, q, "first departures:", first, "identical:", first.count(sp.max_tokens), flush=True)
