"Qwen3-style reasoning (#24): <think> ... </think> to reasoning_content, whole and streamed; enable_thinking and chat_template_kwargs reach the template, unknown keys are 400s."
import json, tempfile
from pathlib import Path
import pytest
from fastapi.testclient import TestClient
from llm_engine.api import build_app
from llm_engine.config import EngineConfig
from llm_engine.engine import AsyncLLMEngine, LLMEngine
from llm_engine.testing import make_tiny_model
from llm_engine.responses import router as responses_router

# Qwen3's shape: ChatML; with enable_thinking false the template writes an empty thinking block into the prompt
QWEN3 = """{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""
# a template that opens the block itself: the answer starts inside it
OPENS = QWEN3.replace("{% endif %}{% endif %}", "{% else %}<think>\n{% endif %}{% endif %}")
MSGS = [{"role": "user", "content": "Hi"}]
THINK = {"regex": "<think>\n[a-z]{2,8}( [a-z]{2,8}){2,4}\n</think>\n\nHello there"}


def _served(template):
    d = make_tiny_model(tempfile.mkdtemp())
    (Path(d) / "chat_template.jinja").write_text(template)
    aeng = AsyncLLMEngine(LLMEngine(EngineConfig.create(model=d, num_blocks=128))).start()
    return aeng, TestClient(build_app(aeng, routers=[responses_router]))


@pytest.fixture(scope="module")
def qwen3():
    aeng, client = _served(QWEN3)
    yield aeng, client
    aeng.shutdown()
    assert aeng.engine.block_manager.num_free_blocks == aeng.engine.block_manager.num_blocks


def _stream(client, body):
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        chunks = [json.loads(l[6:]) for l in s.iter_lines() if l and l != "data: [DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    return ("".join(d.get("reasoning_content") or "" for d in deltas) or None, "".join(d.get("content") or "" for d in deltas) or None,
            chunks[-1]["choices"][0]["finish_reason"])


def test_auto_turns_the_parser_on(qwen3):
    assert qwen3[1].app.state.ctx.reasoning_parser == "qwen3"


def test_thinking_goes_to_reasoning_content(qwen3):
    _, client = qwen3
    body = {"messages": MSGS, "max_tokens": 60, "seed": 1, "structured_outputs": THINK}
    msg = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert msg["content"] == "Hello there"
    assert msg["reasoning_content"].startswith("\n") and msg["reasoning_content"].endswith("\n") and "<think>" not in msg["reasoning_content"]
    assert _stream(client, body) == (msg["reasoning_content"], "Hello there", "stop")


def test_no_thinking_is_all_content_and_a_cut_is_all_reasoning(qwen3):
    _, client = qwen3
    msg = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 8, "structured_outputs": {"regex": "[a-z]{3} [a-z]{3}"}}).json()["choices"][0]["message"]
    assert msg["reasoning_content"] is None and len(msg["content"]) == 7
    body = {"messages": MSGS, "max_tokens": 6, "seed": 1, "structured_outputs": THINK}
    ch = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert ch["finish_reason"] == "length" and ch["message"]["content"] is None and ch["message"]["reasoning_content"]
    assert _stream(client, body) == (ch["message"]["reasoning_content"], None, "length")


def test_enable_thinking_reaches_the_template(qwen3):
    aeng, client = qwen3
    def prompt(**kw):
        r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1, "return_token_ids": True, **kw})
        assert r.status_code == 200, r.text
        return aeng.engine.tokenizer.decode(r.json()["prompt_token_ids"])
    assert "<think>" not in prompt() and "<think>" not in prompt(enable_thinking=True)
    assert prompt(enable_thinking=False).endswith("<think>\n\n</think>\n\n")
    assert prompt(chat_template_kwargs={"enable_thinking": False}) == prompt(enable_thinking=False)


@pytest.mark.parametrize("kw,param", [({"chat_template_kwargs": {"foo": 1}}, "chat_template_kwargs.foo"),
                                      ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
                                      ({"enable_thinking": True, "chat_template_kwargs": {"enable_thinking": False}}, "enable_thinking"),
                                      ({"thinking": True}, "thinking")])
def test_bad_template_kwargs_are_400s(qwen3, kw, param):
    r = qwen3[1].post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1, **kw})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_template_that_opens_the_block():
    aeng, client = _served(OPENS)
    try:
        body = {"messages": MSGS, "max_tokens": 60, "seed": 2, "structured_outputs": {"regex": "[a-z]{2,8}( [a-z]{2,8}){1,3}</think>\n\nDone"}}
        msg = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert msg["content"] == "Done" and msg["reasoning_content"] and "</think>" not in msg["reasoning_content"]
        assert _stream(client, body) == (msg["reasoning_content"], "Done", "stop")
        # the responses API: the thinking is a `reasoning` item, whole and streamed (cut here: the random model never closes it)
        chat = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 12, "temperature": 0}).json()["choices"][0]["message"]
        assert chat["reasoning_content"] and chat["content"] is None
        body = {"input": "Hi", "max_output_tokens": 12, "temperature": 0}
        r = client.post("/v1/responses", json=body).json()
        assert [it["type"] for it in r["output"]] == ["reasoning"] and r["status"] == "incomplete"
        assert r["output"][0]["content"] == [{"type": "reasoning_text", "text": chat["reasoning_content"]}]
        assert r["usage"]["output_tokens_details"]["reasoning_tokens"] == r["usage"]["output_tokens"] == 12   # cut while thinking
        with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as s:
            evs = [json.loads(l[6:]) for l in s.iter_lines() if l.startswith("data: ")]
        types = [e["type"] for e in evs]
        assert types[2] == "response.output_item.added" and evs[2]["item"]["type"] == "reasoning"
        assert "".join(e["delta"] for e in evs if e["type"] == "response.reasoning_text.delta") == chat["reasoning_content"]
        assert types[-3:] == ["response.reasoning_text.done", "response.output_item.done", "response.completed"]
        assert evs[-1]["response"]["output"] == [{**r["output"][0], "id": evs[-1]["response"]["output"][0]["id"]}]
    finally: aeng.shutdown()


def test_no_parser_without_think_in_the_template():
    aeng, client = _served("{% for m in messages %}{{ m.content }}{% endfor %}")
    try:
        assert client.app.state.ctx.reasoning_parser == "none"
        r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 30, "structured_outputs": THINK, "seed": 1}).json()
        msg = r["choices"][0]["message"]
        assert "reasoning_content" not in msg and msg["content"].startswith("<think>")
        r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1, "enable_thinking": False})
        assert r.status_code == 400 and r.json()["error"]["param"] == "enable_thinking"
    finally: aeng.shutdown()


def test_thinking_tokens_count_up_to_the_end_tag(qwen3):
    from llm_engine.responses import thinking_tokens
    tok = qwen3[0].engine.tokenizer
    think, answer = tok("<think>\nab cd\n</think>", add_special_tokens=False)["input_ids"], tok("\n\nHi there", add_special_tokens=False)["input_ids"]
    assert thinking_tokens(tok, think + answer) == len(think) and thinking_tokens(tok, think[:-2]) == len(think) - 2

