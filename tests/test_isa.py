"""Every CPU path this machine can execute, checked: the kernel chapters re-run under each instruction set below the
one detected (`LLM_ENGINE_ISA`, notebook 00), so an AVX-512 machine also tests the AVX2 path most users get, and the
portable loops. One ISA per process: the kernels of two ISAs register the same ops."""
import os, subprocess, sys
from pathlib import Path
import pytest
from llm_engine.config import ISA_NEEDS, CPU_ISA, read_cpu_flags, resolve_isa

NBS = Path(__file__).resolve().parents[1] / "nbs"
OTHERS = [n for n in ISA_NEEDS if n != CPU_ISA.name and set(ISA_NEEDS[n]) <= read_cpu_flags()]
# the chapters whose kernels are compiled per ISA (05b's layer checks include w8a8's, which saturated without VNNI);
# their `slow` cells, the real model scored per precision, take some 10 minutes more per ISA and are run by hand:
# LLM_ENGINE_ISA=avx2 python tools/test_nbs.py --flags slow --path nbs/05b_precision.ipynb
CHAPTERS = {isa: [("03_paged_attention", ""), ("05b_precision", "")] for isa in ("avx2", "generic")}

def _run(isa, nb, flags):
    cmd = ["nbdev_test", "--path", str(NBS / f"{nb}.ipynb"), "--do_print"] + (["--flags", flags] if flags else [])
    return subprocess.run(cmd, env={**os.environ, "LLM_ENGINE_ISA": isa}, capture_output=True, text=True, timeout=1800)

def test_every_isa_this_cpu_runs_is_checked():
    "avx2 wherever AVX2+FMA+F16C are there (both machine kinds this project gets), generic always."
    runnable = {n for n in ISA_NEEDS if set(ISA_NEEDS[n]) <= read_cpu_flags()}
    assert "generic" in runnable and CPU_ISA.name in runnable
    assert set(OTHERS) == runnable - {CPU_ISA.name}, (OTHERS, runnable)

@pytest.mark.parametrize("isa,nb,flags", [(i, nb, f) for i in OTHERS for nb, f in CHAPTERS.get(i, [])])
def test_chapter_under_isa(isa, nb, flags):
    r = _run(isa, nb, flags)
    assert r.returncode == 0, f"{nb} under LLM_ENGINE_ISA={isa}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert "Success" in r.stdout + r.stderr

def test_an_isa_the_cpu_lacks_is_one_clear_error():
    "Not an illegal-instruction crash later: the import names the missing flags and what the CPU can run."
    lacking = next((n for n in ISA_NEEDS if not set(ISA_NEEDS[n]) <= read_cpu_flags()), None)
    if lacking is None:      # this CPU runs every ISA: check the message on a CPU described by its flags instead
        with pytest.raises(ValueError, match="lacks"): resolve_isa("avx512", {"avx2", "fma", "f16c"})
        return
    r = subprocess.run([sys.executable, "-c", "import llm_engine.engine"], env={**os.environ, "LLM_ENGINE_ISA": lacking},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and f"LLM_ENGINE_ISA={lacking} asks for instructions this CPU lacks" in r.stderr
    assert "Illegal instruction" not in r.stderr and r.returncode != -4
