"The engine's trace over HTTP and from the CLI: a finished request's story in words."
import subprocess, sys
import httpx
from openai import OpenAI

def test_trace_endpoint_and_cli(server):
    client = OpenAI(base_url=f"{server.base}/v1", api_key="none")
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Say hi"}],
                                       max_tokens=4, temperature=0)
    t = httpx.get(f"{server.base}/v1/debug/trace", params={"request_id": r.id}, timeout=30).json()
    lines = t["traces"][0]["explanation"]
    assert lines[0].startswith(f"request {r.id}:") and "finished at step" in lines[0]
    assert any("admitted" in l for l in lines)
    cli = subprocess.run([sys.executable, "-m", "llm_engine.cli", "trace", r.id, "--url", server.base],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0 and cli.stdout.splitlines()[0] == lines[0]
    missing = subprocess.run([sys.executable, "-m", "llm_engine.cli", "trace", "chatcmpl-unknown", "--url", server.base],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and "no trace" in missing.stderr
