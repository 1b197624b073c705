"""Fuzzing the live daemon with hypothesis-generated requests: malformed JSON, wrong types,
edge values of every field, odd paths, methods and content types. None may be answered
with a 5xx, every refusal is in OpenAI's error shape, every stream ends with [DONE], and
afterwards the server answers a normal request exactly as before."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.daemon_server import LiveServer, build_serving

EXAMPLES = 400  # each sends 3 requests: 1,200 in all; the test asserts at least 1,000 went out
MAX_MODEL_LEN = 24  # short replies keep the well-formed requests fast

json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) \
    | st.text(max_size=12)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)

EDGES = {
    "model": ["tiny", "other", "../tiny", "", "/etc/passwd"],
    "max_tokens": [-1, 0, 1, 2, 3, 23, 24, 10**9, 2**63, 2**64, 1.5, "3", True],
    "max_completion_tokens": [0, 1, 3, -5, 10**12],
    "temperature": [-1, 0, 1e-9, 0.7, 2, 1e308, -0.0, "hot"],
    "top_p": [0, 1e-12, 0.5, 1, 1.0001, -1],
    "top_k": [-1, 0, 1, 5, 10**6, 2**64],
    "min_p": [-0.1, 0, 0.5, 1, 0.999999],
    "repetition_penalty": [-1, 0, 1e-30, 1, 1.3, 1e30],
    "seed": [-1, 0, 7, 2**63 - 1, 2**63, -(2**63), 2**64],
    "stop": ["", "a", ["a", ""], [""] * 3, ["x"] * 16, ["x"] * 17, "y" * 256, "y" * 257, [1], [None]],
    "stream": [True, False, 1, "yes"],
    "stream_options": [{"include_usage": True}, {"include_usage": "no"}, {}, None, []],
    "logprobs": [True, False, 0, 1, 5, 20, 21, -1],
    "top_logprobs": [0, 1, 20, 21, -1, None],
    "n": [0, 1, 2, -1, None],
    "draft": [True, False, None, 0],
    "echo": [True, False],
    "prompt": ["", "hi", [1, 2, 3], [], [[1, 2]], ["a"], ["a", "b"], [1, "a"], [-1], [511], [512], [2**40],
               [[]], "\udcff", "x" * 400, [1] * 30],
    "messages": [[], "hi", [{}], [{"role": "user"}], [{"role": "user", "content": None}],
                 [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                 [{"role": "user", "content": [{"type": "text"}]}], [{"role": 3, "content": "x"}],
                 [{"role": "user", "content": "\udcff"}], [{"role": "user", "content": "x" * 300}]],
    "tokens": [[], [1, 2], [-1], [2**40], "abc", [[1]]],
    "add_special_tokens": [True, False, "no"],
}
FIELDS = sorted(EDGES)
PATHS = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/v1/models", "/health", "/metrics",
         "/v1/chat/completions/", "/v1/../v1/models", "/nope"]
CONTENT_TYPES = ["application/json", "application/json; charset=utf-8", "text/plain", "application/x-www-form-urlencoded",
                 "application/vnd.api+json", None]

texts = st.text(max_size=16)
parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "text", "image_url", ""]), "text": texts}),
                 max_size=3)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", ""]),
                                           "content": texts | parts | json_values}), min_size=1, max_size=3)
well_formed = st.fixed_dictionaries(
    {"messages": messages},
    optional={field: st.sampled_from(values) for field, values in EDGES.items() if field not in ("messages", "prompt")},
) | st.fixed_dictionaries(
    {"prompt": st.sampled_from(EDGES["prompt"]) | texts},
    optional={field: st.sampled_from(values) for field, values in EDGES.items() if field not in ("messages", "prompt")},
)
wrong_types = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6)
bodies = st.one_of(
    well_formed.map(lambda b: json.dumps(b).encode("utf-8", "surrogatepass")),
    wrong_types.map(lambda b: json.dumps(b).encode()),
    json_values.map(lambda b: json.dumps(b).encode()),
    st.binary(max_size=48),
    well_formed.map(lambda b: json.dumps(b).encode("utf-8", "surrogatepass")[:-3]),  # truncated
)
# A body, and where else to send it besides both completion endpoints.
cases = st.tuples(bodies, st.sampled_from(["POST"] * 3 + ["GET", "PUT", "DELETE"]), st.sampled_from(PATHS),
                  st.sampled_from(CONTENT_TYPES))


@pytest.fixture(scope="module")
def fuzzed(dense_dir):
    serving, _ = build_serving(dense_dir, streams=4, max_model_len=MAX_MODEL_LEN)
    server = LiveServer(serving)
    yield server
    server.close()
    serving.client.shutdown(0)


def send(url: str, method: str, path: str, content_type: str | None, body: bytes) -> tuple[int, str, bytes]:
    address = urlsplit(url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
    try:
        headers = {"Content-Type": content_type} if content_type else {}
        connection.request(method, path, body=body if method in ("POST", "PUT") else None, headers=headers)
        response = connection.getresponse()
        return response.status, response.getheader("Content-Type", ""), response.read()
    finally:
        connection.close()


def test_a_thousand_malformed_requests_get_no_5xx_and_change_nothing(fuzzed):
    normal = ("POST", "/v1/completions", "application/json", json.dumps({"prompt": [1, 20, 30], "max_tokens": 8}).encode())
    status, _, before = send(fuzzed.url, *normal)
    assert status == 200
    statuses: list[int] = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(cases)
    def one(case):
        body, method, path, content_type = case
        for request in (("POST", "/v1/chat/completions", "application/json", body),
                        ("POST", "/v1/completions", "application/json", body), (method, path, content_type, body)):
            status, answered_as, answer = send(fuzzed.url, *request)
            statuses.append(status)
            assert status < 500, (request, answer)
            if status >= 400 and answered_as.startswith("application/json"):
                error = json.loads(answer)["error"]
                assert set(error) == {"message", "type", "param", "code"}
            if status == 200 and answered_as.startswith("text/event-stream"):
                assert answer.rstrip().endswith(b"data: [DONE]")

    one()
    assert len(statuses) >= 1000
    assert {200, 400, 404, 415} <= set(statuses)
    status, _, after = send(fuzzed.url, *normal)
    assert status == 200 and json.loads(after)["choices"] == json.loads(before)["choices"]
    assert send(fuzzed.url, "GET", "/health", None, b"")[0] == 200
