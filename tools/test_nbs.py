"""Run every notebook's tests like `nbdev_test`, but each notebook in a fresh process.

`nbdev_test` reuses its worker processes from one notebook to the next, so whatever a notebook leaves
behind (models, KV caches, glibc arenas that never shrink) adds up: one worker held 13 GB by chapter 08,
and on CI's 24 GB machine the kernel's OOM killer ended a worker, which broke the whole pool
(`BrokenProcessPool`, and a SIGTERM to the notebook running beside it). Here a worker runs one notebook
and exits (`max_tasks_per_child=1`), and each notebook's time and peak memory are printed. Workers share the
cores (`OMP_NUM_THREADS`), never oversubscribe them.

    python tools/test_nbs.py --flags slow            # all of nbs/, two at a time
    python tools/test_nbs.py --path nbs/05b_precision.ipynb
"""
import argparse, os, resource, sys, time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path


def _one(fn: str, flags: str) -> tuple:
    "Test one notebook in this (fresh) process: (passed, seconds, peak RSS in MB)."
    from nbdev.config import get_config
    from nbdev.test import test_nb
    cfg = get_config()
    skip, force = cfg.tst_flags.split(), flags.split()
    t = time.time()
    os.chdir(cfg.nbs_path)
    from llm_engine.testing import private_tmpdir
    with private_tmpdir(f"llm_engine_{Path(fn).stem}_"):      # the notebook's temporary files, removed after it (05a)
        ok, _ = test_nb(Path(fn), skip_flags=skip, force_flags=force, basepath=cfg.config_path)
    return ok, time.time() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flags", default="", help="space-separated test flags to run (as nbdev_test's --flags)")
    p.add_argument("--path", default=None, help="one notebook (default: every notebook in nbs/)")
    p.add_argument("--n_workers", type=int, default=min(2, os.cpu_count() or 1))
    a = p.parse_args(argv)
    from nbdev.config import get_config
    nbs = get_config().nbs_path
    files = [Path(a.path).absolute()] if a.path else sorted(f for f in nbs.glob("*.ipynb") if not f.name.startswith("_"))
    failed, start = [], time.time()
    # each worker gets its share of the cores: two notebooks of 2 OpenMP threads each on 2 cores spin against each
    # other (transformers' generate ran 6x slower beside a copy of itself than alone; 1 thread each, 1.5x)
    # (one notebook alone gets every core)
    workers = max(1, min(a.n_workers, len(files)))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    # spawn, not fork: a worker must not inherit this process's state, and max_tasks_per_child needs it
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), max_tasks_per_child=1) as ex:
        futs = {ex.submit(_one, str(f), a.flags): f for f in files}
        for fut in as_completed(futs):
            f = futs[fut]
            try: ok, secs, mb = fut.result()
            except Exception as e: ok, secs, mb = False, float("nan"), float("nan"); print(f"{f.name}: the worker died: {e!r}", file=sys.stderr)
            print(f"{'ok  ' if ok else 'FAIL'} {f.name}: {secs:.0f} s, peak RSS {mb:,.0f} MB", flush=True)
            if not ok: failed.append(f.name)
    print(f"{len(files) - len(failed)}/{len(files)} notebooks passed in {time.time() - start:.0f} s")
    if failed: print("failed:", *failed, sep="\n\t", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__": sys.exit(main())
