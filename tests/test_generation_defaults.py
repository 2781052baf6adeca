"generation_config.json defaults (#24) through the Responses API: a field the request leaves out takes, and reports, the model's value."
import json, tempfile
from pathlib import Path
from fastapi.testclient import TestClient
from llm_engine.api import build_app
from llm_engine.config import EngineConfig
from llm_engine.engine import AsyncLLMEngine, LLMEngine
from llm_engine.testing import make_tiny_model
from llm_engine.responses import router as responses_router



def test_responses_report_the_models_sampling_defaults():
    "A Responses request that leaves temperature out samples with, and reports, the model's generation_config value."
    d = make_tiny_model(tempfile.mkdtemp())
    g = json.loads((Path(d) / "generation_config.json").read_text())
    (Path(d) / "generation_config.json").write_text(json.dumps({**g, "temperature": 0.0, "top_p": 0.5}))
    aeng = AsyncLLMEngine(LLMEngine(EngineConfig.create(model=d, num_blocks=64))).start()
    try:
        c = TestClient(build_app(aeng, routers=[responses_router]))
        a, b = (c.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 6, "seed": s}).json() for s in (1, 2))
        assert (a["temperature"], a["top_p"]) == (0.0, 0.5) and a["output"] == [{**b["output"][0], "id": a["output"][0]["id"]}]
        r = c.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 6, "temperature": 1.0}).json()
        assert (r["temperature"], r["top_p"]) == (1.0, 0.5)
    finally: aeng.shutdown()
