"Structured outputs and tool calling (issue 14) with the official `openai` client against the real server on the default model."
import asyncio, json, re
import jsonschema, openai, pytest
from pydantic import BaseModel, Field

MSG = [{"role": "user", "content": "Describe a person as JSON."}]

# small schemas, strings bounded, so that 60 tokens always suffice to finish them at temperature 1.0
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}, "rain": {"type": "boolean"}},
           "required": ["city", "unit", "rain"], "additionalProperties": False}
TAGS = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}, "ok": {"type": "boolean"}},
        "required": ["tags", "ok"], "additionalProperties": False}

GET_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
               "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                              "required": ["city", "unit"], "additionalProperties": False}}}
GET_TIME = {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 16}}, "required": ["tz"], "additionalProperties": False}}}
TOOLS = [GET_WEATHER, GET_TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# "required" allows parallel calls by default, and the 135M model then tends to repeat its call until max_tokens
# ("length"); one call per answer keeps these tests about the format, not about the model's judgement
ONE = {"parallel_tool_calls": False}

@pytest.fixture(scope="module")
def client(server): return openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=300)

@pytest.fixture(scope="module")
def model(client): return client.models.list().data[0].id

@pytest.mark.parametrize("name,schema", [("person", PERSON), ("weather", WEATHER), ("tags", TAGS)])
def test_json_schema_strict_20_concurrent(server, model, name, schema):
    aclient = openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=300)
    rf = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    async def one(i):
        return await aclient.chat.completions.create(model=model, messages=MSG, response_format=rf, temperature=1.0, max_tokens=60, seed=i)
    async def all_():
        try: return await asyncio.gather(*(one(i) for i in range(20)))
        finally: await aclient.close()
    outs = asyncio.run(all_())
    for r in outs:
        c = r.choices[0]
        assert c.finish_reason == "stop", (c.finish_reason, c.message.content)
        jsonschema.validate(json.loads(c.message.content), schema)
    assert len({r.choices[0].message.content for r in outs}) > 1   # temperature 1.0 really sampled

# bounded fields, which the grammar enforces: a sampled object then ends within max_tokens whatever the seed draws
# (unbounded, 2 seeds in 10 ran a name or an age past 80 tokens)
class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=150)

def test_parse_with_pydantic(client, model):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    r = parse(model=model, messages=MSG, response_format=Person, max_tokens=80, temperature=0.7, seed=1)
    p = r.choices[0].message.parsed
    assert isinstance(p, Person) and r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert len(p.name) <= 24 and 0 <= p.age <= 150

@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call(client, model, choice):
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=80, temperature=1.0, seed=2, **ONE)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
    for call in c.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        if isinstance(choice, dict): assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])

@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_call_streamed(client, model, choice):
    calls, finish = {}, None
    for chunk in client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=80,
                                                temperature=1.0, seed=3, stream=True, **ONE):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                cur = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id: cur["id"] = d.id
                if d.function and d.function.name: cur["name"] = d.function.name
                if d.function and d.function.arguments: cur["arguments"] += d.function.arguments
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and calls
    for c in calls.values():
        assert c["id"] and c["name"] in PARAMS
        if isinstance(choice, dict): assert c["name"] == "get_time"
        jsonschema.validate(json.loads(c["arguments"]), PARAMS[c["name"]])

def test_two_turn_tool_conversation(client, model):
    first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80, seed=4, **ONE)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "cloudy"})}]
    r = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=30, temperature=0)   # auto
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    assert c.message.content or c.message.tool_calls
    assert r.usage.prompt_tokens > first.usage.prompt_tokens   # the call and its result were rendered into the prompt

def test_invalid_schema_is_400(client, model):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=MSG, response_format=bad, max_tokens=5)
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=MSG, max_tokens=5, extra_body={"guided_regex": "(", "guided_choice": ["a"]})
    assert e.value.body["param"] in ("guided_regex", "guided_choice")   # two sources: refused, naming one of them

def test_regex_and_choice_via_extra_body(client, model):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Give me a phone number."}], max_tokens=20,
                                       temperature=1.0, n=4, seed=5, extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    for c in r.choices: assert re.fullmatch(r"\d{3}-\d{4}", c.message.content) and c.finish_reason == "stop", c.message.content
    r = client.completions.create(model=model, prompt="My favourite colour is", max_tokens=10, temperature=1.0, n=4, seed=6,
                                  extra_body={"guided_choice": ["red", "green", "blue"]})
    for c in r.choices: assert c.text in ("red", "green", "blue") and c.finish_reason == "stop", c.text

def _strict_json(text):
    def refuse(c): raise ValueError(f"{c} is not JSON")
    return json.loads(text, parse_constant=refuse)    # Python's reader would accept NaN / -Infinity; JSON clients do not

def test_logprobs_of_masked_tokens_are_json(client, model, server):
    "top_logprobs wider than what the grammar allows: the forbidden tokens show -9999.0 (JSON has no -inf), in both routes and in a stream."
    import httpx
    body = {"model": model, "prompt": "Pick one:", "max_tokens": 4, "temperature": 0, "logprobs": 5, "guided_choice": ["yes", "no"]}
    r = httpx.post(f"{server.base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    tops = _strict_json(r.text)["choices"][0]["logprobs"]["top_logprobs"]
    assert -9999.0 in tops[-1].values() and all(v >= -9999.0 for d in tops for v in d.values())
    c = client.chat.completions.create(model=model, messages=MSG, max_tokens=4, temperature=0, logprobs=True, top_logprobs=5,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert c.choices[0].message.content in ("yes", "no")
    assert -9999.0 in [t.logprob for t in c.choices[0].logprobs.content[-1].top_logprobs]
    with httpx.stream("POST", f"{server.base}/v1/completions", json={**body, "stream": True}, timeout=120) as s:
        events = [_strict_json(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert any(-9999.0 in d.values() for e in events for d in (e["choices"][0]["logprobs"] or {}).get("top_logprobs") or [])
