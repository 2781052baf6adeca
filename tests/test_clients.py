"""The client libraries people put in front of an OpenAI-compatible server (issue 25), each used as its own docs show,
against `llm-engine serve` on the embedded model: the official `openai` client (chat, Responses), instructor,
LangChain's ChatOpenAI, the OpenAI Agents SDK and pydantic-ai. Each at temperature 0, and at 1 with a seed.
Installed by the `clients` extra (pip install -e ".[dev,clients]")."""
import asyncio, json
import httpx, jsonschema, openai, pytest
from pydantic import BaseModel, Field

SAMPLING = [pytest.param({"temperature": 0.0}, id="t0"), pytest.param({"temperature": 1.0, "seed": 7}, id="t1-seed")]

class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)

WEATHER_CALLS = []

def get_weather(city: str) -> str:
    "Get the current weather in a city."
    WEATHER_CALLS.append(city)
    return f"It is 18 degrees and cloudy in {city}."

ASK_WEATHER = "What is the weather in Paris? Use the get_weather tool."
ASK_CITY = "Name one large city in France."

@pytest.fixture(scope="module")
def base(server): return f"{server.base}/v1"

@pytest.fixture(scope="module")
def model(base): return openai.OpenAI(base_url=base, api_key="unused").models.list().data[0].id

@pytest.fixture(scope="module")
def client(base): return openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300)

def seed_of(s): return {"seed": s["seed"]} if "seed" in s else {}

def blocks_free(server):
    import time
    for _ in range(100):
        st = httpx.get(f"{server.base}/v1/stats").json()
        if st["kv_blocks_used"] == 0: return True
        time.sleep(0.1)
    return False

# ---- the official openai client

@pytest.mark.parametrize("s", SAMPLING)
def test_openai_chat_parse(client, model, s):
    r = client.chat.completions.parse(model=model, messages=[{"role": "user", "content": ASK_CITY}], response_format=City, max_tokens=60, **s)
    assert isinstance(r.choices[0].message.parsed, City), r.choices[0].message.content

@pytest.mark.parametrize("s", SAMPLING)
def test_openai_responses_create_and_previous_id(client, model, s):
    r = client.responses.create(model=model, input="Say hello.", instructions="Be brief.", max_output_tokens=16,
                                temperature=s["temperature"], extra_body=seed_of(s))
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.output_text
    r2 = client.responses.create(model=model, input="Again, in French.", previous_response_id=r.id, max_output_tokens=8,
                                 temperature=s["temperature"], extra_body=seed_of(s))
    assert r2.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens   # the first turn is in the prompt
    assert client.responses.retrieve(r.id).id == r.id
    client.responses.delete(r2.id)
    with pytest.raises(openai.NotFoundError): client.responses.retrieve(r2.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=model, input="x", previous_response_id="resp_unknown123")
    assert "resp_unknown123" in str(e.value)

@pytest.mark.parametrize("s", SAMPLING)
def test_openai_responses_parse(client, model, s):
    r = client.responses.parse(model=model, input=ASK_CITY, text_format=City, max_output_tokens=60,
                               temperature=s["temperature"], extra_body=seed_of(s))
    assert isinstance(r.output_parsed, City), r.output_text

@pytest.mark.parametrize("s", SAMPLING)
def test_openai_responses_stream_events(client, model, s):
    whole = client.responses.create(model=model, input="Count to five.", max_output_tokens=12, temperature=s["temperature"], extra_body=seed_of(s))
    kinds, text, final = [], "", None
    with client.responses.stream(model=model, input="Count to five.", max_output_tokens=12, temperature=s["temperature"], extra_body=seed_of(s)) as st:
        for ev in st:
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta": text += ev.delta
        final = st.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed" and final.status == whole.status
    assert "response.output_text.delta" in kinds and text == final.output_text == whole.output_text

@pytest.mark.parametrize("s", SAMPLING)
def test_openai_responses_function_call_loop(client, model, s):
    tools = [{"type": "function", "name": "get_weather", "description": "Get the current weather in a city.", "strict": True,
              "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"], "additionalProperties": False}}]
    r = client.responses.create(model=model, input=ASK_WEATHER, tools=tools, tool_choice="required", parallel_tool_calls=False,
                                max_output_tokens=60, temperature=s["temperature"], extra_body=seed_of(s))
    call = [o for o in r.output if o.type == "function_call"][0]
    args = json.loads(call.arguments); jsonschema.validate(args, tools[0]["parameters"])
    out = client.responses.create(model=model, previous_response_id=r.id, tools=tools, max_output_tokens=30, temperature=s["temperature"],
                                  input=[{"type": "function_call_output", "call_id": call.call_id, "output": get_weather(args["city"])}], extra_body=seed_of(s))
    assert out.status in ("completed", "incomplete") and out.output
    # streamed: the argument deltas add up to the call
    with client.responses.stream(model=model, input=ASK_WEATHER, tools=tools, tool_choice="required", parallel_tool_calls=False,
                                 max_output_tokens=60, temperature=s["temperature"], extra_body=seed_of(s)) as st:
        deltas = "".join(ev.delta for ev in st if ev.type == "response.function_call_arguments.delta")
        fin = st.get_final_response()
    assert deltas == [o for o in fin.output if o.type == "function_call"][0].arguments

# ---- instructor

@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
@pytest.mark.parametrize("s", SAMPLING)
def test_instructor(client, model, mode, s):
    import instructor
    ic = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    city = ic.chat.completions.create(model=model, response_model=City, messages=[{"role": "user", "content": ASK_CITY}],
                                      max_tokens=80, max_retries=0, **s)
    assert isinstance(city, City)

# ---- LangChain

def chat_openai(base, model, s, **kw):
    from langchain_openai import ChatOpenAI
    return ChatOpenAI(base_url=base, api_key="unused", model=model, max_retries=0, timeout=600, temperature=s["temperature"], **seed_of(s), **kw)

@pytest.mark.parametrize("s", SAMPLING)
def test_langchain_invoke_stream(base, model, s):
    llm = chat_openai(base, model, s, max_tokens=12)
    whole = llm.invoke("Say hello.").content
    assert whole and "".join(c.content for c in llm.stream("Say hello.")) == whole

@pytest.mark.parametrize("choice", ["any", "auto"])
@pytest.mark.parametrize("s", SAMPLING)
def test_langchain_bind_tools(base, model, choice, s):
    from langchain_core.tools import tool
    llm = chat_openai(base, model, s, max_tokens=60).bind_tools([tool(get_weather)], tool_choice=choice)
    msg = llm.invoke(ASK_WEATHER)
    assert not msg.invalid_tool_calls and "<tool_call>" not in msg.content, msg
    if choice == "any": assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather" and isinstance(msg.tool_calls[0]["args"]["city"], str)
    else: assert msg.tool_calls or msg.content
    chunks = list(llm.stream(ASK_WEATHER))
    full = chunks[0]
    for c in chunks[1:]: full = full + c
    if choice == "any": assert full.tool_calls and full.tool_calls[0]["name"] == "get_weather", full

@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
@pytest.mark.parametrize("s", SAMPLING)
def test_langchain_structured_output(base, model, method, s):
    llm = chat_openai(base, model, s, max_tokens=80)
    if method == "json_mode":   # json_mode guarantees a JSON object, not its keys: a dict schema gets the parsed dict
        out = llm.with_structured_output(City.model_json_schema(), method=method).invoke(ASK_CITY + " Answer in JSON.")
        assert isinstance(out, dict)
    else: assert isinstance(llm.with_structured_output(City, method=method).invoke(ASK_CITY), City)

# ---- the OpenAI Agents SDK

@pytest.mark.parametrize("kind", ["chat", "responses"])
@pytest.mark.parametrize("s", SAMPLING)
def test_agents_sdk_required_tool(base, model, kind, s):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    set_tracing_disabled(True)    # no traces sent anywhere
    aclient = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300)
    m = (OpenAIChatCompletionsModel if kind == "chat" else OpenAIResponsesModel)(model=model, openai_client=aclient)
    WEATHER_CALLS.clear()
    agent = Agent(name="weather", instructions="You answer weather questions with the get_weather tool.", model=m,
                  tools=[function_tool(get_weather)], tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=s["temperature"], max_tokens=60, extra_body=seed_of(s) or None))
    async def run():
        try: return await Runner.run(agent, ASK_WEATHER, max_turns=3)
        finally: await aclient.close()
    result = asyncio.run(run())
    assert len(WEATHER_CALLS) == 1 and result.final_output == f"It is 18 degrees and cloudy in {WEATHER_CALLS[0]}."   # really called, its result used

# ---- pydantic-ai

def pai_model(base, model):
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    return OpenAIChatModel(model, provider=OpenAIProvider(base_url=base, api_key="unused"))

@pytest.mark.parametrize("native", [False, True], ids=["tool-output", "native-output"])
@pytest.mark.parametrize("s", SAMPLING)
def test_pydantic_ai_output_type(base, model, native, s, server):
    from pydantic_ai import Agent, NativeOutput
    agent = Agent(pai_model(base, model), output_type=NativeOutput(City) if native else City, retries=0,
                  model_settings={"max_tokens": 80, **s})
    r = agent.run_sync(ASK_CITY)
    assert isinstance(r.output, City)
    assert blocks_free(server)

# ---- the official openai client: embeddings (chapter 10c)

def test_openai_embeddings_create(client, model):
    import base64, numpy as np
    texts = ["The cat sat on the mat.", "Stock markets fell on Monday.", "The cat sat on the mat."]
    floats = client.embeddings.create(model=model, input=texts, encoding_format="float")
    default = client.embeddings.create(model=model, input=texts)          # the client asks for base64 and decodes it
    raw = client.embeddings.create(model=model, input=texts[0], encoding_format="base64")   # asked for: left encoded
    e = np.array([d.embedding for d in floats.data])
    np.testing.assert_allclose(np.array([d.embedding for d in default.data]), e, atol=1e-7)
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(raw.data[0].embedding), dtype="<f4"), e[0].astype(np.float32))
    assert abs(e[0] @ e[2] - 1.0) < 1e-6 and e[0] @ e[1] < 0.999
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0 and floats.model == model
    one = client.embeddings.create(model=model, input=texts[1], encoding_format="float").data[0].embedding
    np.testing.assert_allclose(one, e[1], atol=1e-5)
    with pytest.raises(openai.BadRequestError) as err: client.embeddings.create(model=model, input="x", dimensions=8)
    assert "dimensions" in str(err.value)

def test_langchain_openai_embeddings(base, model, client):
    "LangChain's OpenAIEmbeddings, with check_embedding_ctx_length=False: by default it sends ids of OpenAI's tokenizer (chapter 10c)."
    import numpy as np
    from langchain_openai import OpenAIEmbeddings
    emb = OpenAIEmbeddings(base_url=base, api_key="unused", model=model, check_embedding_ctx_length=False, max_retries=0)
    docs = ["The cat sat on the mat.", "Stock markets fell on Monday."]
    got = np.array(emb.embed_documents(docs))
    want = np.array([d.embedding for d in client.embeddings.create(model=model, input=docs, encoding_format="float").data])
    np.testing.assert_allclose(got, want, atol=1e-6)
    np.testing.assert_allclose(emb.embed_query(docs[0]), want[0], atol=1e-5)
