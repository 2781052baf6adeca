"Smoke test of the benchmark harness: it runs, and its JSON has the fields the README table is built from."
import json, subprocess, sys

def test_bench_quick(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "llm_engine.cli", "bench", "--quick", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    systems = {row["system"] for row in res["rows"]}
    assert {"hf_sequential", "hf_static_batch8", "llm_engine"} <= systems
    for row in res["rows"]: assert {"tok_s", "output_tokens", "seconds", "speedup_vs_hf_sequential", "peak_rss_mb"} <= set(row)
    http = res["http"]
    assert [h["concurrency"] for h in http] == [1, 2]
    for h in http:
        assert {"tok_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "peak_rss_mb", "kv_blocks_peak"} <= set(h)
        assert h["output_tokens"] > 0
    assert out.with_suffix(".png").exists()
