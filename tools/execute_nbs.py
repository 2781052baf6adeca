"""Re-execute every notebook in reading order and save it with its outputs, then clean it with nbdev_clean.

The book is committed executed so a reader on GitHub sees every table and picture. Each notebook seeds its
own random state, so re-running changes only timings.

    python tools/execute_nbs.py                 # all notebooks
    python tools/execute_nbs.py 03 07a          # those whose names start with these prefixes
    python tools/execute_nbs.py --flags slow    # also run cells flagged `slow` (the default skips none of them)
"""
import argparse, os, re, subprocess, sys, time
from pathlib import Path
from execnb.nbio import read_nb, write_nb
from execnb.shell import CaptureShell

ROOT = Path(__file__).resolve().parents[1]
NBS = ROOT / "nbs"
# Cells carrying one of these flags need hardware this machine may lack; `--flags` can force them.
SKIP_FLAGS = {"cuda"}

def cell_flags(src: str) -> set:
    "The nbdev directives (`#| slow`, `#| cuda` ...) at the top of a cell."
    flags = set()
    for line in src.splitlines():
        m = re.match(r"\s*#\s*\|\s*(.*)", line)
        if not m: break
        flags.update(m.group(1).split())
    return flags

def reading_order(prefixes=()) -> list:
    # index.ipynb opens the book but imports the finished package, so it runs after the chapters
    nbs = sorted(p for p in NBS.glob("*.ipynb") if p.name != "index.ipynb") + [NBS / "index.ipynb"]
    return [p for p in nbs if not prefixes or any(p.name.startswith(x) for x in prefixes)]

def execute(path: Path, skip: set) -> float:
    nb = read_nb(path)
    def no_eval(cell):
        flags = cell_flags(cell.source)
        # `eval: false` cells are not meant to run in a kernel (the CLI's `__main__` guard would exit it)
        return (cell.cell_type != "code" or "nbdev_export(" in cell.source or bool(flags & skip)
                or {"eval:", "false"} <= flags)
    shell, start = CaptureShell(path, mpl_format="png"), time.time()
    shell._fname = path     # prettytb names the notebook in a failure
    cwd = os.getcwd(); os.chdir(path.parent)
    from llm_engine.testing import private_tmpdir
    try:
        with private_tmpdir(f"llm_engine_{path.stem}_"):      # the notebook's temporary files, removed after it (05a)
            shell.run_all(nb, exc_stop=True, preproc=no_eval)
    except Exception as e: raise RuntimeError(f"{path.name} failed:\n{shell.prettytb(fname=path)}") from e
    finally: os.chdir(cwd)
    write_nb(nb, path)
    subprocess.run(["nbdev_clean", "--fname", str(path)], check=True, cwd=ROOT)
    return time.time() - start

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prefixes", nargs="*", help="notebook name prefixes to run (default: all)")
    ap.add_argument("--flags", default="", help="space-separated flags to run even though they are skipped by default")
    a = ap.parse_args()
    skip = SKIP_FLAGS - set(a.flags.split())
    total, t0 = [], time.time()
    for p in reading_order(a.prefixes):
        dt = execute(p, skip)
        total.append((p.name, dt))
        print(f"{p.name:32s} {dt:7.1f} s", flush=True)
    size = sum(p.stat().st_size for p in NBS.glob("*.ipynb"))
    print(f"{len(total)} notebooks in {time.time() - t0:.0f} s; nbs/ holds {size / 2**20:.1f} MiB")

if __name__ == "__main__": main()
