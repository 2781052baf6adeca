"""Fuzzing from outside (tools/fuzz.py runs 3,000+ cases): schemathesis over the served OpenAPI schema, and extreme
floats, NaN and infinities in every numeric field of both generation requests. Every answer is a 2xx or a 4xx with
OpenAI's error JSON; no 5xx, no hang, no traceback in the server log, no KV block left behind."""
import sys
from pathlib import Path
import pytest

pytest.importorskip("schemathesis", reason="schemathesis is not installed (pip install schemathesis)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from soak import LoggedServer, tiny_model
from fuzz import run_fuzz, SERVER_ARGS

def test_fuzz_schema_and_extreme_floats():
    srv = LoggedServer("--model", tiny_model(), *SERVER_ARGS)
    try: res = run_fuzz(srv.base, 600, srv.log_text, seed=3)
    finally: rc = srv.stop()
    print("\n" + res.line())
    assert res.cases >= 550 and res.by_source.get("schemathesis", 0) > 100 and res.by_source.get("extreme", 0) > 100
    assert res.by_source.get("pair", 0) >= 50       # float32 edges two at a time (the reproducer is one)
    assert res.server_errors == 0 and res.hangs == 0 and res.bad_error_json == 0, res.examples
    assert res.tracebacks == 0 and res.blocks_leaked == 0 and rc == 0
    assert int(res.by_status.get("200", 0)) >= 50      # the fuzzer reached generation, not only validation
