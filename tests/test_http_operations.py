"""What operators expect on the HTTP API's port besides the OpenAI routes: /metrics (the whole
service's series, labelled `model_name`), /tokenize and /detokenize (vLLM's shapes), /version,
and `X-Request-Id` taken as the request's id and echoed on every response. With the core's
frontend in its own process and in the core's."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import stepahead
from stepahead.processes import Service, serving_pair
from tests.live import CALL_TIMEOUT_S, FRONTEND_COUNTS, frontend_flags, unused_port, wait_all_free, wait_until
from tests.test_openai_api import CHAT_TEMPLATE, TINY

SERVED_NAME = "ops/tiny"
THINKING = "{% if enable_thinking is defined and enable_thinking %}<think>{% endif %}"  # a kwarg it reads


@pytest.fixture(scope="module", params=FRONTEND_COUNTS, ids=lambda n: f"frontends={n}")
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    template = tmp_path_factory.mktemp("chat") / "template.jinja"
    template.write_text(CHAT_TEMPLATE + THINKING)
    flags = ["--http-port", str(unused_port()), "--chat-template", str(template)]
    flags += ["--served-model-name", SERVED_NAME, "--access-log", *frontend_flags(request.param)]
    with serving_pair(TINY, flags) as (_, scheduler):
        yield scheduler


def http(service: Service) -> httpx2.Client:
    return httpx2.Client(base_url=service.http_url, timeout=CALL_TIMEOUT_S)


def client(service: Service) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{service.http_url}/v1", api_key="unused", max_retries=0)


def test_metrics_on_the_api_port_are_the_service_s_labelled_with_the_model_name(tiny: Service) -> None:
    reply = client(tiny).completions.create(
        model=SERVED_NAME, prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True}
    )  # a sampled EOS (the tiny model's vocabulary is small) would end it early
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    with http(tiny) as h:
        got = h.get("/metrics")
    assert got.status_code == 200 and got.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(got.text)}
    # The core's own series and the frontends' (tokens streamed to clients), in one exposition.
    assert "stepahead_requests_running" in families and "stepahead_generation_tokens" in families
    generated = sum(
        s.value for s in families["stepahead_generation_tokens"].samples if s.name.endswith("_total")
    )
    assert generated >= 3
    unlabelled = [
        s.name for f in families.values() for s in f.samples if s.labels.get("model_name") != SERVED_NAME
    ]
    assert unlabelled == []


def test_tokenize_and_detokenize_round_trip_text_and_chat(tiny: Service) -> None:
    with http(tiny) as h:
        text = "Grüß dich, world"
        got = h.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
        # The tiny model's tokens are UTF-8 bytes (offset past its specials): one per byte.
        assert got["count"] == len(text.encode()) == len(got["tokens"]) and got["max_model_len"] > 0
        assert "".join(got["token_strs"]).encode(errors="replace") != b"" and got["token_strs"][0] == "G"
        back = h.post("/detokenize", json={"tokens": got["tokens"], "model": SERVED_NAME}).json()
        assert back == {"prompt": text}
        chat = h.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
        rendered = "[user] Hi|[assistant] "
        assert h.post("/detokenize", json={"tokens": chat["tokens"]}).json() == {"prompt": rendered}
        assert chat["token_strs"] is None and chat["count"] == len(rendered.encode())


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": ""}, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": []}, None),
        ("/tokenize", {}, None),
        (  # a turn continued needs add_generation_prompt false
            "/tokenize",
            {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
            "continue_final_message",
        ),
        ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
        ("/detokenize", {"tokens": [1, 10**6]}, "tokens[1]"),
        ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
        ("/detokenize", {"tokens": "12"}, "tokens"),
    ],
)
def test_bad_tokenize_bodies_are_refused_naming_the_field(
    tiny: Service, path: str, body: dict[str, object], param: str | None
) -> None:
    with http(tiny) as h:
        got = h.post(path, json=body)
        assert got.status_code in (400, 404), got.text
        error = got.json()["error"]
        assert error["param"] == param, error
        assert h.post("/tokenize", json={"prompt": "ok"}).json()["count"] == 2  # still serving


def test_version(tiny: Service) -> None:
    with http(tiny) as h:
        assert h.get("/version").json() == {"version": stepahead.__version__}


def test_x_request_id_names_the_completion_and_comes_back_on_every_response(tiny: Service) -> None:
    c = client(tiny)
    raw = c.chat.completions.with_raw_response.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        extra_headers={"X-Request-Id": "trace-42"},
    )
    assert raw.headers["x-request-id"] == "trace-42" and raw.parse().id == "chatcmpl-trace-42"
    stream = c.completions.with_raw_response.create(
        model=SERVED_NAME, prompt="Hi", max_tokens=2, stream=True, extra_headers={"X-Request-Id": "s-7"}
    )
    assert stream.headers["x-request-id"] == "s-7"
    assert {chunk.id for chunk in stream.parse()} == {"cmpl-s-7"}
    with http(tiny) as h:
        for method, path in (("GET", "/v1/models"), ("GET", "/nowhere"), ("POST", "/v1/completions")):
            got = h.request(method, path, headers={"X-Request-Id": "any-1"}, json={})
            assert got.headers["x-request-id"] == "any-1", (method, path, got.status_code)
        bad = h.get("/v1/models", headers={"X-Request-Id": "x" * 200})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-request-id"
        assert "x-request-id" not in h.get("/v1/models").headers  # none given: none made up


# ---- fields ---------------------------------------------------------------------------------------


def test_a_documented_field_asked_for_what_is_not_served_is_a_400_naming_it(tiny: Service) -> None:
    c = client(tiny)
    refused_extras: list[dict[str, object]] = [
        {"truncate_prompt_tokens": 5},
        {"length_penalty": 0.5},
        {"use_beam_search": True},
    ]
    for extra in refused_extras:
        with pytest.raises(openai.BadRequestError) as refused:
            c.completions.create(model=SERVED_NAME, prompt="Hi", max_tokens=2, extra_body=extra)
        assert refused.value.body["param"] == next(iter(extra)), refused.value.body  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as refused:
        c.chat.completions.create(
            model=SERVED_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, metadata={"a": "b"}
        )
    assert refused.value.body["param"] == "metadata"  # type: ignore[index]
    served = c.chat.completions.create(  # the Responses API's hints, accepted here too
        model=SERVED_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        safety_identifier="user-1",
        prompt_cache_key="greetings",
        extra_body={"ignore_eos": True},
    )
    assert served.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as refused:
        c.chat.completions.create(
            model=SERVED_NAME,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2,
            extra_body={"best_of": 3},
        )
    assert refused.value.body["param"] == "best_of"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as refused:
        c.completions.create(
            model=SERVED_NAME, prompt="Hi", max_tokens=2, extra_body={"modalities": ["audio"]}
        )
    assert refused.value.body["param"] == "modalities"  # type: ignore[index]
    # What is served (the default, however OpenAI spells it) passes, and so does a field no API
    # documents (logged).
    served_extras: list[dict[str, object]] = [
        {"min_p": 0.0},
        {"skip_special_tokens": True},
        {"modalities": ["text"]},
        {"service_tier": "auto"},
        {"service_tier": "default"},
        {"no_api_has": [1]},
    ]
    for extra in served_extras:
        body = {**extra, "ignore_eos": True}  # both tokens, whatever is sampled
        reply = c.completions.create(model=SERVED_NAME, prompt="Hi", max_tokens=2, extra_body=body)
        assert reply.usage is not None and reply.usage.completion_tokens == 2


def test_echo_puts_the_prompt_before_each_choice(tiny: Service) -> None:
    c = client(tiny)
    plain = c.completions.create(model=SERVED_NAME, prompt="Once", max_tokens=4, temperature=0)
    echoed = c.completions.create(model=SERVED_NAME, prompt="Once", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "Once" + plain.choices[0].text
    with http(tiny) as h:
        prompt_ids = h.post("/tokenize", json={"prompt": "Once"}).json()["tokens"]
    ids = c.completions.create(model=SERVED_NAME, prompt=prompt_ids, max_tokens=4, echo=True, temperature=0)
    assert ids.choices[0].text == echoed.choices[0].text  # ids are echoed as their text
    streamed = c.completions.create(
        model=SERVED_NAME, prompt="Once", max_tokens=4, temperature=0, echo=True, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == echoed.choices[0].text
    scored = c.completions.create(model=SERVED_NAME, prompt="Once", max_tokens=2, echo=True, logprobs=1)
    lp = scored.choices[0].logprobs  # the prompt's tokens too, the first with no log-probability
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == len(prompt_ids) + 2 and "".join(lp.tokens).startswith("Once")
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(tiny: Service) -> None:
    options: Any = {
        "include_usage": True,
        "continuous_usage_stats": True,
    }  # vLLM's key: not in the client's type
    stream = client(tiny).chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        stream=True,
        stream_options=options,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks and all(chunk.usage is not None for chunk in chunks)
    counts = [chunk.usage.completion_tokens for chunk in chunks if chunk.usage is not None]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 5
    plain = client(tiny).chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert [chunk.usage is not None for chunk in plain][-1:] == [True]


def test_the_access_log_has_a_line_for_each_request_once_it_ends(tiny: Service) -> None:
    with http(tiny) as h:
        h.post(
            "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers={"X-Request-Id": "logged-1"}
        )
        h.get("/v1/models/nosuch", headers={"X-Request-Id": "logged-2"})

    def logged(status: str, rid: str, route: str) -> bool:
        return any(
            route in line and f" {status} " in line and line.rstrip().endswith(rid) for line in tiny.output
        )

    wait_until(lambda: logged("200", "logged-1", '"POST /v1/completions"'), "the completion logged")
    wait_until(lambda: logged("404", "logged-2", '"GET /v1/models/nosuch"'), "the 404 logged")


def test_chat_template_kwargs_reach_the_template(tiny: Service) -> None:
    rendered = "[user] Hi|[assistant] "
    messages: list[Any] = [{"role": "user", "content": "Hi"}]
    with http(tiny) as h:
        thinking = h.post(
            "/tokenize", json={"messages": messages, "chat_template_kwargs": {"enable_thinking": True}}
        )
        ids = thinking.json()["tokens"]
        assert h.post("/detokenize", json={"tokens": ids}).json() == {"prompt": rendered + "<think>"}
    c = client(tiny)
    for kwargs, prompt in (
        ({"enable_thinking": True}, rendered + "<think>"),
        ({"enable_thinking": False}, rendered),
    ):
        reply = c.chat.completions.create(
            model=SERVED_NAME, messages=messages, max_tokens=1, extra_body={"chat_template_kwargs": kwargs}
        )
        assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt.encode())
    refused_kwargs: list[tuple[object, str]] = [
        ({"messages": []}, "chat_template_kwargs.messages"),
        ([1], "chat_template_kwargs"),
    ]
    for bad, param in refused_kwargs:
        with pytest.raises(openai.BadRequestError) as refused:
            c.chat.completions.create(
                model=SERVED_NAME,
                messages=messages,
                max_tokens=1,
                extra_body={"chat_template_kwargs": bad},
            )
        assert refused.value.body["param"] == param, refused.value.body  # type: ignore[index]


def test_min_p_reaches_the_worker_s_sampler(tiny: Service) -> None:
    """min_p 1 keeps only the likeliest token: a sampled reply is the greedy one (the parameter
    crossed frontend, core and worker); out of range is a 400 naming it."""
    c = client(tiny)
    greedy = c.completions.create(model=SERVED_NAME, prompt="Once", max_tokens=8, temperature=0)
    for seed in (1, 2):
        sampled = c.completions.create(
            model=SERVED_NAME,
            prompt="Once",
            max_tokens=8,
            temperature=1.0,
            seed=seed,
            extra_body={"min_p": 1.0},
        )
        assert sampled.choices[0].text == greedy.choices[0].text
    with pytest.raises(openai.BadRequestError) as refused:
        c.completions.create(model=SERVED_NAME, prompt="Once", max_tokens=2, extra_body={"min_p": 1.5})
    assert refused.value.body["param"] == "min_p"  # type: ignore[index]


def test_a_list_of_prompts_gives_each_prompt_s_choices_in_order(tiny: Service) -> None:
    c = client(tiny)
    prompts = ["Once", "Upon a", "Time"]
    alone = [c.completions.create(model=SERVED_NAME, prompt=p, max_tokens=4, temperature=0) for p in prompts]
    listed = c.completions.create(model=SERVED_NAME, prompt=prompts, max_tokens=4, temperature=0, n=2)
    assert [choice.index for choice in listed.choices] == list(range(6))
    for i, reply in enumerate(alone):  # choice i x n + j is completion j of prompt i
        assert [listed.choices[2 * i + j].text for j in (0, 1)] == [reply.choices[0].text] * 2
    assert listed.usage is not None and alone[0].usage is not None
    assert listed.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in alone if r.usage is not None)
    assert listed.usage.completion_tokens == 6 * 4
    streamed = c.completions.create(
        model=SERVED_NAME, prompt=prompts, max_tokens=4, temperature=0, echo=True, stream=True
    )
    texts = ["", "", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [p + r.choices[0].text for p, r in zip(prompts, alone, strict=True)]
    with http(tiny) as h:
        ids = [h.post("/tokenize", json={"prompt": p}).json()["tokens"] for p in prompts[:2]]
    by_ids = c.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=4, temperature=0)
    assert [choice.text for choice in by_ids.choices] == [r.choices[0].text for r in alone[:2]]


def test_a_bad_prompt_in_a_list_is_named_and_nothing_of_the_call_stays(tiny: Service) -> None:
    c = client(tiny)
    with pytest.raises(openai.BadRequestError) as refused:
        c.completions.create(model=SERVED_NAME, prompt=["Once", ""], max_tokens=4)
    assert refused.value.body["param"] == "prompt[1]"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as refused:
        c.completions.create(model=SERVED_NAME, prompt=["x"] * 129, max_tokens=1)
    assert refused.value.body["param"] == "prompt"  # type: ignore[index]
    asyncio.run(wait_all_free(tiny.address))  # the first prompt's admitted request was ended
