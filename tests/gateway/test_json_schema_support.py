"""Which JSON schemas structured outputs take (shared/openai_protocol/json_schema_support.py),
checked against the installed xgrammar, the way the policy was found: every schema the check
takes compiles to a grammar (with a real tokenizer's vocabulary, as the gateway compiles it)
that accepts values the schema accepts and refuses values it refuses (jsonschema confirms
both lists); every keyword it refuses is named with its place, and where the reason is that
xgrammar lets a breaking value through, the test shows that value getting through (should a
later xgrammar enforce it, this fails and the keyword can be allowed)."""
from __future__ import annotations

import asyncio
import json
import random

import jsonschema
import pytest

from services.gateway.openai_api.structured_outputs import checked, response_format_grammar, tool_choice_grammar
from shared.engine.grammar import compile_spec
from shared.engine.grammar_guard import GrammarGuard
from shared.engine.grammar_limits import GrammarLimits
from shared.engine.grammar_spec import GrammarError, GrammarSpec
from shared.engine.grammar_trial import check_can_start
from shared.openai_protocol.errors import InvalidRequest
from shared.openai_protocol.json_schema_refs import rebase_refs
from shared.openai_protocol.json_schema_support import schema_problem
from shared.openai_protocol.json_schema_walk import TYPED_KEYWORDS
from shared.openai_protocol.requests import parse_chat_request
from shared.openai_protocol.responses import parse_responses_request
from tests.helpers.gateway_support import byte_level_tokenizer_dir

pytestmark = pytest.mark.timeout(300)

INT, STR = {"type": "integer"}, {"type": "string"}
LINKED = {"$defs": {"node": {"type": "object", "properties": {
    "v": INT, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
    "required": ["v", "next"], "additionalProperties": False}}, "$ref": "#/$defs/node"}

# (schema, values it takes, values it refuses): each accepted by the check and enforced
ENFORCED = [
    ({"type": "object", "properties": {"a": INT, "b": STR}, "required": ["a"], "additionalProperties": False},
     [{"a": 1}, {"a": 1, "b": "x"}], [{"b": "x"}, {"a": "1"}, {"a": 1, "c": 2}]),
    ({"type": "integer", "minimum": 1, "maximum": 10}, [1, 10], [0, 11, 1.5, "1"]),
    ({"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 10, "multipleOf": 3}, [3, 9], [1, 4, 12]),
    ({"type": "number", "minimum": -1.5, "maximum": 2.5}, [-1.5, 0, 2.25], [-2, 3]),
    ({"type": "string", "minLength": 2, "maxLength": 3}, ["ab", "abc"], ["a", "abcd", 12]),
    ({"type": "string", "pattern": "^[a-c]+$"}, ["abc"], ["xyz", ""]),
    ({"type": "string", "format": "date"}, ["2024-01-02"], ["yesterday"]),
    ({"type": "string", "format": "email"}, ["a@b.co"], ["nobody"]),
    ({"type": "string", "format": "uuid"}, ["123e4567-e89b-12d3-a456-426614174000"], ["x"]),
    ({"type": "string", "format": "int64", "maxLength": 2}, ["12"], ["123"]),  # not a standard format: annotation
    ({"type": ["string", "null"], "maxLength": 2}, ["ab", None], ["abc", 1]),
    ({"enum": ["a", 1, None, {"b": 2}]}, ["a", 1, None], ["b", 2]),
    ({"type": "string", "const": "x", "description": "d"}, ["x"], ["y"]),
    ({"anyOf": [STR, INT], "title": "t"}, ["x", 1], [1.5, None]),
    ({"oneOf": [STR, INT]}, ["x", 1], [1.5]),
    ({"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}, "x": INT}, "required": ["k"]},
                {"type": "object", "properties": {"k": {"const": "b"}, "y": STR}, "required": ["k"]}]},
     [{"k": "a", "x": 1}, {"k": "b"}], [{"k": "c"}, {"k": "a", "x": "s"}]),
    ({"allOf": [{"$ref": "#/$defs/n"}], "$defs": {"n": INT}, "description": "pydantic's field wrapper"}, [1], ["x"]),
    ({"type": "array", "items": INT, "minItems": 1, "maxItems": 2, "uniqueItems": False}, [[1], [1, 1]],
     [[], [1, 2, 3], ["x"]]),
    ({"type": "array", "prefixItems": [INT, STR], "items": False}, [[1, "x"]], [[1, 2], [1, "x", 3]]),
    ({"type": "object", "additionalProperties": INT, "minProperties": 1, "maxProperties": 2}, [{"a": 1}],
     [{}, {"a": "x"}, {"a": 1, "b": 2, "c": 3}]),
    ({"type": "object", "patternProperties": {"^x_[a-z]+$": INT}, "additionalProperties": False}, [{"x_a": 1}],
     [{"y": 1}, {"x_a": "s"}]),
    ({"type": "object", "propertyNames": {"pattern": "^[a-c]+$"}, "additionalProperties": INT}, [{"ab": 1}],
     [{"zz": 1}]),
    ({"type": "object", "properties": {"a": INT}, "unevaluatedProperties": False}, [{"a": 1}], [{"a": 1, "b": 2}]),
    ({"properties": {"a": INT}, "required": ["a"]}, [{"a": 1}], [{"a": "x"}]),  # typeless: an object
    ({"type": "object", "properties": {"a": {"$ref": "#"}}}, [{}, {"a": {"a": {}}}], [{"a": 1}]),
    (LINKED, [{"v": 1, "next": None}, {"v": 1, "next": {"v": 2, "next": None}}], [{"v": 1}, {"v": 1, "next": 2}]),
    ({"anyOf": [STR, {"type": "array", "items": {"$ref": "#"}, "minItems": 1}]}, ["x", ["x"], [["x"]]], [[], [1]]),
    ({"$defs": {"x": {"not": {}}}, "type": "integer", "contentEncoding": "base64"}, [1], ["x"]),  # unused defs
]

# (schema, keyword, its place, a value the schema refuses that xgrammar's grammar lets through or None)
REFUSED = [
    ({"type": "object", "properties": {"a": {"not": STR}}, "required": ["a"]}, "not", "$.properties.a", None),
    ({"not": STR}, "not", "$", "x"),
    ({"allOf": [STR, INT]}, "allOf", "$", "x"),
    ({"allOf": [{"type": "integer", "minimum": 3}, {"type": "integer", "maximum": 5}]}, "allOf", "$", 9),
    ({"$ref": "#"}, "$ref", "$", None),
    ({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
      "$ref": "#/$defs/n"}, "$ref", "$", None),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "type": "object",
      "properties": {"x": {"$ref": "#/$defs/a"}}}, "$ref", "$.properties.x", None),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "$ref", "$.items", None),
    ({"$ref": "http://example.com/s.json"}, "$ref", "$", None),
    ({"$defs": {"x": {"$anchor": "x", "type": "integer"}}, "$ref": "#x"}, "$ref", "$", None),
    ({"$defs": {"a/b": INT}, "$ref": "#/$defs/a~1b"}, "$ref", "$", None),
    ({"$defs": {"n": INT}, "$ref": "#/$defs/n", "minimum": 3}, "minimum", "$", 1),
    ({"type": "string", "anyOf": [{"minLength": 2}, {"const": "a"}]}, "type", "$", 1),
    ({"type": "object", "properties": {"a": INT}, "required": ["a"], "if": {"properties": {"a": {"const": 1}}},
      "then": {"required": ["b"]}}, "if", "$", None),
    ({"type": "object", "properties": {"a": INT, "b": INT}, "dependentRequired": {"a": ["b"]}},
     "dependentRequired", "$", {"a": 1}),
    ({"type": "object", "properties": {"a": INT, "b": INT}, "dependentSchemas": {"a": {"required": ["b"]}}},
     "dependentSchemas", "$", {"a": 1}),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "properties": {"a": INT, "b": INT},
      "dependencies": {"a": ["b"]}}, "dependencies", "$", {"a": 1}),
    ({"type": "array", "items": INT, "uniqueItems": True}, "uniqueItems", "$", [1, 1]),
    ({"type": "array", "items": INT, "contains": {"const": 5}}, "contains", "$", [1]),
    ({"type": "array", "items": [INT]}, "items", "$", None),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf", "$", 1.2),
    ({"type": "integer", "multipleOf": 1.5}, "multipleOf", "$", 1),
    ({"multipleOf": 3}, "multipleOf", "$", 4),
    ({"minLength": 2}, "minLength", "$", "a"),
    ({"type": "string", "format": "regex"}, "format", "$", "("),
    ({"type": "string", "format": "idn-email"}, "format", "$", "nobody"),
    ({"type": "string", "format": "iri"}, "format", "$", None),  # (this jsonschema cannot check iri)
    ({"type": "string", "pattern": "^a+$", "minLength": 3}, "minLength", "$", "a"),
    ({"type": "string", "format": "email", "pattern": "^a"}, "pattern", "$", "b@b.co"),
    ({"type": "string", "format": "email", "maxLength": 6}, "maxLength", "$", "ab@bc.co"),
    ({"type": "string", "const": "abc", "maxLength": 2}, "maxLength", "$", "abc"),
    ({"type": "string", "enum": ["a", 1]}, "enum", "$", 1),
    ({"type": "object", "properties": {}, "required": ["a"], "additionalProperties": INT}, "required", "$", {}),
    ({"type": "object", "properties": {"ba": INT}, "patternProperties": {"^b": {"type": "integer", "minimum": 5}}},
     "patternProperties", "$", {"ba": 1}),
    ({"type": "object", "patternProperties": {"^x.*$": INT, "^.*y$": {"type": "integer", "minimum": 5}},
      "additionalProperties": False}, "patternProperties", "$", {"xy": 1}),
    ({"type": "object", "properties": {"long": INT}, "propertyNames": {"maxLength": 1}}, "propertyNames", "$",
     {"long": 1}),
    ({"oneOf": [INT, {"type": "integer", "minimum": 0}]}, "oneOf", "$", 1),
    ({"oneOf": [INT, {"type": "number"}]}, "oneOf", "$", 1),
    ({"type": []}, "type", "$", None),
    ({"anyOf": []}, "anyOf", "$", None),
    ({"type": "object", "properties": {"a": {"$id": "http://x/a", "type": "integer"}}}, "$id", "$.properties.a",
     None),
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(byte_level_tokenizer_dir(tmp_path_factory.mktemp("tok"))))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    import xgrammar as xgr
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer)),
                               max_threads=1, cache_enabled=False)


def validator(schema):
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def grammar_takes(compiler, schema, value) -> bool:
    """Whether the schema's grammar accepts value as written compact (how output comes out)."""
    import xgrammar as xgr
    matcher = xgr.GrammarMatcher(compile_spec(compiler, GrammarSpec("json_schema", json.dumps(schema))))
    return matcher.accept_string(json.dumps(value)) and matcher.is_completed()


@pytest.mark.parametrize("schema,takes,refuses", ENFORCED, ids=lambda v: None)
def test_a_schema_the_check_takes_is_enforced_by_xgrammar(compiler, schema, takes, refuses):
    assert schema_problem(schema) is None
    check = validator(schema)
    for value in takes:
        assert check.is_valid(value), value
        assert grammar_takes(compiler, schema, value), value
    for value in refuses:
        assert not check.is_valid(value), value
        assert not grammar_takes(compiler, schema, value), value


@pytest.mark.parametrize("schema,keyword,path,slips", REFUSED, ids=lambda v: None)
def test_a_keyword_xgrammar_does_not_enforce_is_named_with_its_place(compiler, schema, keyword, path, slips):
    problem = schema_problem(schema)
    assert problem is not None and (problem.keyword, problem.path) == (keyword, path), problem
    assert str(problem).startswith(f"keyword '{keyword}' at {path} ")
    if slips is not None:  # why: the schema refuses it, the grammar lets it through
        assert not validator(schema).is_valid(slips)
        assert grammar_takes(compiler, schema, slips), f"xgrammar now enforces {keyword!r}: allow it"


def test_recursion_with_no_way_out_gives_a_grammar_nothing_fits(compiler):
    """Why {"$ref": "#"} failed on the worker ("token 0 does not fit the grammar"): xgrammar
    0.2.8 compiles it to `root ::= root`, which allows no first token, and the start check
    refuses that grammar by name; xgrammar 0.2.9 refuses the circular $ref while compiling.
    Either way the trial compile (gateway and workers) answers a GrammarError naming why."""
    with pytest.raises(GrammarError, match="no JSON value fits this json schema|[Cc]ircular"):
        check_can_start(compile_spec(compiler, GrammarSpec("json_schema", json.dumps({"$ref": "#"}))),
                        "json_schema")
    with pytest.raises(GrammarError, match="no JSON value fits"):  # only the end is allowed: ""
        check_can_start(compile_spec(compiler, GrammarSpec("json_schema", json.dumps({"anyOf": []}))),
                        "json_schema")
    check_can_start(compile_spec(compiler, GrammarSpec("json_schema", json.dumps(LINKED))), "json_schema")


def test_a_problem_reads_keyword_place_and_why():
    problem = schema_problem({"type": "object", "properties": {"a": {"not": STR}}})
    assert str(problem) == "keyword 'not' at $.properties.a is not supported (a schema's complement cannot be " \
                           "generated)"
    assert schema_problem({"type": "object", "properties": {"a b": {"not": {}}}}).path == '$.properties["a b"]'


def test_any_json_at_all_gets_an_answer_not_an_exception():
    """Keywords holding values of every wrong kind (a hostile client's): a problem or None,
    never a crash (which the helper would turn into "the grammar compiler failed")."""
    rng = random.Random(5)
    keys = list(TYPED_KEYWORDS) + ["type", "const", "enum", "$ref", "anyOf", "oneOf", "allOf", "$defs", "not", "x"]
    leaves = [None, True, False, 0, 2.5, "", "#", "#/$defs/a", "#/properties", "string", ["a"], ["string", "null"]]

    def value(depth):
        pick = rng.random()
        if depth > 4 or pick < 0.3:
            return rng.choice(leaves)
        if pick < 0.55:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(keys): value(depth + 1) for _ in range(rng.randint(0, 4))}

    answers = [schema_problem(value(1)) for _ in range(3000)]
    assert any(a is None for a in answers) and any(a is not None for a in answers)


@pytest.fixture(scope="module")
def guard(tokenizer):
    g = GrammarGuard.for_tokenizer(GrammarLimits(timeout_s=30), tokenizer)
    yield g
    g.close()


def gateway_check(guard, body: dict, responses: bool = False):
    """What the gateway does with a request's schemas (endpoints.py): parse, build the
    grammar, have the guard judge it (a helper process); the InvalidRequest, or None."""
    if responses:
        req = parse_responses_request(json.dumps({"input": "hi", **body}).encode())
        grammar = response_format_grammar(req.format, "text.format", "text.format.schema")
        if req.tools:
            grammar = tool_choice_grammar(req.tools, req.effective_tool_choice, None, flat=True) or grammar
    else:
        req = parse_chat_request(json.dumps({"messages": [{"role": "user", "content": "hi"}], **body}).encode())
        grammar = response_format_grammar(req.response_format)
        if req.tools:
            grammar = tool_choice_grammar(req.tools, req.effective_tool_choice, None) or grammar
    try:
        asyncio.run(checked(guard, grammar))
    except InvalidRequest as exc:
        return exc
    return None


def test_each_way_a_schema_comes_in_is_refused_with_its_field(guard):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}
    refused = gateway_check(guard, {"response_format": fmt})
    assert refused.param == "response_format"
    assert refused.message.startswith("response_format.json_schema.schema: keyword '$ref' at $ makes the schema")
    refused = gateway_check(guard, {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"not": STR}}}},
                            responses=True)
    assert (refused.param, refused.message[:37]) == ("text.format", "text.format.schema: keyword 'not' at ")
    bad = {"type": "object", "properties": {"a": {"allOf": [STR, INT]}}}
    good = {"type": "object", "properties": {"a": INT}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": good}},
             {"type": "function", "function": {"name": "g", "parameters": bad}}]
    assert gateway_check(guard, {"tools": tools}) is None  # auto: no grammar, nothing enforced
    assert gateway_check(guard, {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}}) \
        is None
    for choice in ("required", {"type": "function", "function": {"name": "g"}}):
        refused = gateway_check(guard, {"tools": tools, "tool_choice": choice})
        assert refused.param == "tools[1].function.parameters"
        assert refused.message.startswith("tools[1].function.parameters: keyword 'allOf' at $.properties.a ")
    flat = [{"type": "function", "name": "g", "parameters": bad}]
    refused = gateway_check(guard, {"tools": flat, "tool_choice": "required"}, responses=True)
    assert refused.param == "tools[0].parameters"


def test_what_only_the_compile_tells_names_the_place_too(guard):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}}}}]
    refused = gateway_check(guard, {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert refused.param == "tools[0].function.parameters"
    assert refused.message.startswith("tools[0].function.parameters: invalid json schema: ")
    assert "minimum" in refused.message


def test_a_worker_asked_directly_refuses_it_too(tokenizer):
    """A worker's guard (its own vocabulary, shipping slow compiles) runs the same trial: a
    schema sent to it over gRPC without the gateway never reaches its engine."""
    from shared.engine.grammar import GrammarBackend
    backend = GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    worker_guard = GrammarGuard.for_tokenizer_info(GrammarLimits(timeout_s=30), backend.info.serialize_json)
    try:
        with pytest.raises(GrammarError, match=r"^keyword '\$ref' at \$ makes the schema recurse"):
            asyncio.run(worker_guard.check(GrammarSpec("json_schema", json.dumps({"$ref": "#"}))))
        with pytest.raises(GrammarError, match=r"^keyword 'not' at \$ "):
            asyncio.run(worker_guard.check(GrammarSpec("json_schema", json.dumps({"not": STR}))))
    finally:
        worker_guard.close()


def test_required_tool_calls_keep_each_functions_refs(compiler):
    """tool_choice "required" puts every function's parameters into one list schema; a
    function's $refs ("#" its own root, "#/$defs/...") are rebased onto where it went."""
    own = {"type": "object", "properties": {"unit": {"$ref": "#/$defs/unit"},
                                            "sub": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
           "required": ["unit", "sub"], "additionalProperties": False,
           "$defs": {"unit": {"enum": ["c", "f"]}}}
    assert rebase_refs(own, "/$defs/tool_0")["properties"]["sub"]["anyOf"][0] == {"$ref": "#/$defs/tool_0"}
    tools = [{"type": "function", "function": {"name": "f", "parameters": own}},
             {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {}}}}]
    grammar = tool_choice_grammar(tools, "required", None)
    schema = json.loads(grammar.spec.text)
    call = {"name": "f", "parameters": {"unit": "c", "sub": {"unit": "f", "sub": None}}}
    assert grammar_takes(compiler, schema, [call, {"name": "g", "parameters": {}}])
    assert not grammar_takes(compiler, schema, [{"name": "f", "parameters": {"unit": "c", "sub": [call]}}])
    assert not grammar_takes(compiler, schema, [{"name": "f", "parameters": {"unit": "k", "sub": None}}])
