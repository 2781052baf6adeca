"Tool-call formats per family (#24): auto selection from the model folder's chat template, forced calls, streamed deltas, history through the template."
import json, tempfile
from pathlib import Path
import jsonschema, pytest
from fastapi.testclient import TestClient
from llm_engine.api import build_app
from llm_engine.config import EngineConfig
from llm_engine.engine import AsyncLLMEngine, LLMEngine
from llm_engine.testing import make_tiny_model
from llm_engine.tool_parsers import parse_tool_output
from llm_engine.responses import router as responses_router

# A Llama-3.1-like template: tools in an `Environment: ipython` system turn, calls as {"name", "parameters"} JSON,
# results in the ipython role; the arguments written with `tojson` (they must reach it as an object)
LLAMA31 = """{{- bos_token }}{%- if tools %}<|start_header_id|>system<|end_header_id|>

Environment: ipython
Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|eot_id|>{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for tc in message.tool_calls %}{{ '{"name": "' + tc.function.name + '", "parameters": ' + tc.function.arguments | tojson + '}' }}{% endfor %}<|eot_id|>
{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

# A Mistral-like template: tools before the first user turn, calls after [TOOL_CALLS] with 9-character ids
MISTRAL = """{{- bos_token }}{%- set ns = namespace(shown=false) %}{%- for message in messages %}
{%- if message.role == 'user' %}{% if tools and not ns.shown %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% set ns.shown = true %}{% endif %}[INST]{{ message.content }}[/INST]
{%- elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS][{% for tc in message.tool_calls %}{% if tc.id|length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}, "id": "{{ tc.id }}"}{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}
{%- elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]
{%- elif message.role == 'assistant' %}{{ message.content }}{{ eos_token }}
{%- else %}{{ message.content }}
{%- endif %}{%- endfor %}"""

# Mistral's newer templates (Mistral Small 3.2, Devstral): each call as [TOOL_CALLS]name[ARGS]{...}
MISTRAL_V11 = MISTRAL.replace(
    """[TOOL_CALLS][{% for tc in message.tool_calls %}{% if tc.id|length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}, "id": "{{ tc.id }}"}{% if not loop.last %}, {% endif %}{% endfor %}]""",
    """{% for tc in message.tool_calls %}[TOOL_CALLS]{{ tc.function.name }}[CALL_ID]{{ tc.id }}[ARGS]{{ tc.function.arguments | tojson }}{% endfor %}""")

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"enum": [1, 2, 3]}},
          "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
MSGS = [{"role": "user", "content": "Weather in Paris?"}]


def _served(template: str|None):
    d = make_tiny_model(tempfile.mkdtemp())
    if template is not None: (Path(d) / "chat_template.jinja").write_text(template)
    aeng = AsyncLLMEngine(LLMEngine(EngineConfig.create(model=d, num_blocks=128))).start()
    return aeng, TestClient(build_app(aeng, routers=[responses_router]))


@pytest.fixture(scope="module", params=[("llama3_json", LLAMA31), ("mistral", MISTRAL), ("mistral_v11", MISTRAL_V11), ("hermes", None)], ids=lambda p: p[0])
def served(request):
    fmt, template = request.param
    aeng, client = _served(template)
    yield fmt, aeng, client
    aeng.shutdown()
    bm = aeng.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_auto_picks_the_format_of_the_template(served):
    fmt, _, client = served
    assert client.app.state.ctx.tool_call_parser == fmt


def _stream(client, body):
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        return [json.loads(l[6:]) for l in s.iter_lines() if l and l != "data: [DONE]"]


def _calls_from_deltas(chunks):
    "Per index: id, name, arguments; checks each call's first delta has id and name, and no later one does."
    calls = {}
    for ch in chunks:
        for d in ch["choices"][0]["delta"].get("tool_calls", []):
            c = calls.get(d["index"])
            if c is None:
                assert d["id"] and d["type"] == "function" and "name" in d["function"], d
                calls[d["index"]] = c = {"id": d["id"], "name": d["function"]["name"], "arguments": ""}
            else: assert "id" not in d and "name" not in d["function"], d
            c["arguments"] += d["function"]["arguments"]
    assert list(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)]


def test_named_call_forced_streamed_and_whole(served):
    fmt, aeng, client = served
    body = {"messages": MSGS, "tools": TOOLS, "max_tokens": 60, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    r = client.post("/v1/chat/completions", json=body).json()
    ch = r["choices"][0]
    assert ch["finish_reason"] == "tool_calls", r
    call, = ch["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS)
    if fmt.startswith("mistral"): assert len(call["id"]) == 9 and call["id"].isalnum()
    chunks = _stream(client, body)
    streamed, = _calls_from_deltas(chunks)
    assert (streamed["name"], streamed["arguments"]) == (call["function"]["name"], call["function"]["arguments"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_required_cut_by_max_tokens_keeps_finished_calls(served):
    fmt, aeng, client = served
    tk = aeng.engine.tokenizer
    # every token with a "]" held down, in both requests (the same first call): a random model may close the list
    # after its first call, where the grammar allows a second; held down, it goes on to one (where the grammar leaves
    # only closing tokens, as after the last call, the mask still lets them through)
    no_close = {str(i): -100 for i in range(len(tk)) if "]" in tk.decode([i])}
    one = {"messages": MSGS, "tools": TOOLS, "max_tokens": 60, "temperature": 0, "tool_choice": "required", "parallel_tool_calls": False,
           "logit_bias": no_close}
    r1 = client.post("/v1/chat/completions", json=one).json()
    assert r1["choices"][0]["finish_reason"] == "tool_calls" and len(r1["choices"][0]["message"]["tool_calls"]) == 1
    first = r1["choices"][0]["message"]["tool_calls"][0]["function"]
    cut = {**one, "parallel_tool_calls": True, "logit_bias": {**no_close, str(tk.eos_token_id): -100}, "max_tokens": r1["usage"]["completion_tokens"] + 4}
    ch = client.post("/v1/chat/completions", json=cut).json()["choices"][0]
    assert ch["finish_reason"] == "length"
    assert [c["function"] for c in ch["message"]["tool_calls"]] == [first]
    chunks = _stream(client, cut)
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in _calls_from_deltas(chunks)] == [first]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_history_goes_through_the_models_template(served):
    "The model's own template renders the tools, the assistant's call (arguments as an object) and the result."
    fmt, aeng, client = served
    tk, ctx = aeng.engine.tokenizer, client.app.state.ctx
    cid = "abc123XYZ"     # 9 alphanumerics, as Mistral's template demands
    history = MSGS + [{"role": "assistant", "content": None, "tool_calls": [{"id": cid, "type": "function",
                       "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
                      {"role": "tool", "tool_call_id": cid, "content": "21 C"}]
    r = client.post("/v1/chat/completions", json={"messages": history, "tools": TOOLS, "max_tokens": 3, "return_token_ids": True})
    assert r.status_code == 200, r.text
    shown = tk.decode(r.json()["prompt_token_ids"])
    if fmt == "llama3_json":
        assert ctx.template_has_tools and "Environment: ipython" in shown and '"name": "get_weather"' in shown
        assert '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}' in shown, shown
        assert "<|start_header_id|>ipython<|end_header_id|>\n\n21 C" in shown
    elif fmt == "mistral":
        assert ctx.template_has_tools and "[AVAILABLE_TOOLS]" in shown
        assert '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}, "id": "abc123XYZ"}]' in shown, shown
        assert "[TOOL_RESULTS]21 C[/TOOL_RESULTS]" in shown
    elif fmt == "mistral_v11":
        assert '[TOOL_CALLS]get_weather[CALL_ID]abc123XYZ[ARGS]{"city": "Paris", "days": 2}' in shown, shown
    else:
        assert "<tools>" in shown and "<tool_response>\n21 C\n</tool_response>" in shown


def test_responses_api_uses_the_format(served):
    fmt, aeng, client = served
    body = {"input": "Weather in Paris?", "tools": [{"type": "function", **t["function"]} for t in TOOLS], "max_output_tokens": 60,
            "temperature": 0, "tool_choice": {"type": "function", "name": "get_weather"}}
    r = client.post("/v1/responses", json=body).json()
    item, = [it for it in r["output"] if it["type"] == "function_call"]
    assert item["name"] == "get_weather"
    jsonschema.validate(json.loads(item["arguments"]), PARAMS)
    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as s:
        evs = [json.loads(l[6:]) for l in s.iter_lines() if l.startswith("data: ")]
    done = [e["item"] for e in evs if e["type"] == "response.output_item.done"]
    assert [(d["type"], d["name"], d["arguments"]) for d in done] == [("function_call", "get_weather", item["arguments"])]
    assert "".join(e["delta"] for e in evs if e["type"] == "response.function_call_arguments.delta") == item["arguments"]


def test_explicit_parser_and_bad_name():
    "An explicit --tool-call-parser wins over auto; the fallback prompt then speaks that format; a bad name is refused."
    aeng, client = _served(None)
    try:
        app = build_app(aeng, tool_call_parser="mistral")
        c = TestClient(app)
        assert app.state.ctx.tool_call_parser == "mistral"
        r = c.post("/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS, "max_tokens": 100, "temperature": 0,
                                                 "tool_choice": "required", "parallel_tool_calls": False, "return_token_ids": True}).json()
        assert "[TOOL_CALLS] followed by a JSON list" in aeng.engine.tokenizer.decode(r["prompt_token_ids"])
        text = aeng.engine.tokenizer.decode(r["choices"][0]["token_ids"])
        assert text.startswith("[TOOL_CALLS][{") and len(parse_tool_output("mistral", text).tool_calls) == 1
        with pytest.raises(ValueError, match="tool_call_parser must be one of"): build_app(aeng, tool_call_parser="pythonic")
    finally: aeng.shutdown()
