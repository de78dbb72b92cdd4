"""The mocker's constrained sampling (llguidance masks) and its logits sampler, driven through
``MockerCore`` with the tiny model's real tokenizer: outputs must satisfy their constraint, end,
and honour the sampling options a client sends."""

from __future__ import annotations

import json
import re
from collections import Counter

import jsonschema
import pytest
from tokenizers import Tokenizer

from dynamod.daemon.engines.mocker.core import MockerCore
from dynamod.daemon.engines.mocker.guided import GuidedVocab
from dynamod.daemon.models.local import resolve_model
from dynamod.shared.protocol.llm import GuidedDecoding, SamplingOptions
from tests.unit.mocker.factories import make_config, run_to_completion

TINY = resolve_model("tiny")
TOKENIZER = Tokenizer.from_file(str(TINY.tokenizer_path))
VOCAB = GuidedVocab(TINY.tokenizer_path, TINY.vocab_size, TINY.eos_token_ids)

ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.org$"}},
            "required": ["name", "email"],
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {"sku": {"enum": ["A1", "B2", "C3"]}, "qty": {"type": "number"}, "gift": {"type": "boolean"}},
                "required": ["sku", "qty"],
            },
        },
        "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 20}]},
        "meta": {"type": "object"},
    },
    "required": ["id", "customer", "items"],
}


def _core(**overrides) -> MockerCore:
    knobs = dict(vocab_size=TINY.vocab_size, eos_token_ids=tuple(TINY.eos_token_ids), num_gpu_blocks=4096,
                 block_size=16, max_num_seqs=256, max_num_batched_tokens=8192)
    knobs.update(overrides)
    return MockerCore(make_config(**knobs))


def _run(core: MockerCore) -> tuple[dict[str, list[int]], dict[str, str], list]:
    outs = run_to_completion(core)
    tokens: dict[str, list[int]] = {}
    for out in outs:
        for rid, tok in zip(out.req_ids, out.token_ids, strict=True):
            tokens.setdefault(rid, []).append(tok)
    finish = {f.request_id: f.finish_reason for out in outs for f in out.finished}
    return tokens, finish, outs


def _generate(guided: GuidedDecoding, n: int, *, max_tokens: int = 400, **sampling) -> list[tuple[str, str]]:
    core = _core()
    for i in range(n):
        options = SamplingOptions(guided_decoding=guided, **sampling)
        core.add_request(f"r{i}", [1, 2, 3, i % 4000 + 1], max_tokens=max_tokens, sampling=options,
                         guided=VOCAB.new_state(guided, seed=i))
    tokens, finish, _ = _run(core)
    return [(TOKENIZER.decode(tokens[f"r{i}"]), finish[f"r{i}"]) for i in range(n)]


def test_a_thousand_json_schema_generations_all_validate() -> None:
    validator = jsonschema.Draft202012Validator(ORDER)
    results = _generate(GuidedDecoding(json=ORDER), 1000)
    for text, finish in results:
        assert finish == "stop", (finish, text)
        validator.validate(json.loads(text))
    # Random, not one canned answer.
    assert len({text for text, _ in results}) > 990


def test_regex_choice_and_grammar_outputs_match() -> None:
    for text, finish in _generate(GuidedDecoding(regex=r"[A-Z]{2}-\d{3,5}( [a-z]+)?"), 50, max_tokens=60):
        assert finish == "stop" and re.fullmatch(r"[A-Z]{2}-\d{3,5}( [a-z]+)?", text), text
    choices = ["alpha", "beta gamma", "δέλτα", '{"quoted": 1}']
    seen = Counter(text for text, _ in _generate(GuidedDecoding(choice=choices), 80, max_tokens=30))
    assert set(seen) <= set(choices) and len(seen) >= 3
    grammar = 'root ::= item ("," item)*\nitem ::= [a-c]+ | "(" root ")"'
    lark_like = re.compile(r"[a-c(),]+")
    for text, finish in _generate(GuidedDecoding(grammar=grammar), 40, max_tokens=120):
        assert finish == "stop" and lark_like.fullmatch(text) and text.count("(") == text.count(")"), text


def test_short_budget_truncates_instead_of_running_on() -> None:
    results = _generate(GuidedDecoding(json=ORDER), 20, max_tokens=6)
    assert all(finish == "length" for _, finish in results)


def test_invalid_constraint_is_refused_at_compile() -> None:
    from dynamod.shared.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="Invalid type"):
        VOCAB.new_state(GuidedDecoding(json={"type": "strin"}), seed=0)


def test_plain_requests_keep_the_lcg_and_report_no_logprobs() -> None:
    core = _core()
    core.add_request("plain", [1, 2, 3], max_tokens=5, sampling=SamplingOptions(temperature=0.7, top_p=0.9, seed=1))
    assert core.scheduler.requests["plain"].sampler is None
    _, _, outs = _run(core)
    assert not any(out.logprobs for out in outs)


def test_logprobs_are_plausible_and_top_alternatives_sorted() -> None:
    core = _core()
    core.add_request("lp", [1, 2, 3], max_tokens=30, ignore_eos=True, sampling=SamplingOptions(logprobs=5, seed=4))
    tokens, _, outs = _run(core)
    entries = [(lp, top) for out in outs for rid, lp, top in out.logprobs if rid == "lp"]
    assert len(entries) == len(tokens["lp"]) == 30
    near_top = 0
    for token, (lp, top) in zip(tokens["lp"], entries, strict=True):
        assert lp <= 0.0 and len(top) == 5
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True) and len({t for t, _ in top}) == 5
        assert all(0 <= t < TINY.vocab_size for t, _ in top)
        if token in {t for t, _ in top}:
            near_top += 1
            assert dict(top)[token] == pytest.approx(lp)
    assert near_top >= 20  # sampled from a peaked distribution: mostly among the top five


def test_logit_bias_allowed_ids_and_penalties() -> None:
    core = _core()
    # A +100 bias makes a token all but certain; -100 bans one.
    core.add_request("force", [1, 2], max_tokens=20, ignore_eos=True, sampling=SamplingOptions(logit_bias={77: 100.0}))
    core.add_request(
        "ban", [1, 2], max_tokens=40, ignore_eos=True,
        sampling=SamplingOptions(allowed_token_ids=[10, 11, 12], logit_bias={11: -100.0}),
    )
    # A strong frequency penalty over two allowed tokens at temperature 0 forces alternation.
    core.add_request(
        "freq", [1, 2], max_tokens=20, ignore_eos=True,
        sampling=SamplingOptions(allowed_token_ids=[20, 21], frequency_penalty=2.0, temperature=0.0, logit_bias={20: 3.0}),
    )
    core.add_request(
        "nofreq", [1, 2], max_tokens=20, ignore_eos=True,
        sampling=SamplingOptions(allowed_token_ids=[20, 21], temperature=0.0, logit_bias={20: 30.0}),
    )
    tokens, _, _ = _run(core)
    assert tokens["force"] == [77] * 20
    assert set(tokens["ban"]) <= {10, 12} and len(set(tokens["ban"])) == 2
    assert tokens["nofreq"] == [20] * 20
    assert 5 <= tokens["freq"].count(21) <= 15


def test_min_tokens_masks_stop_tokens_in_the_sampler() -> None:
    core = _core()
    eos = TINY.eos_token_ids[0]
    core.add_request("m", [1, 2], max_tokens=30, min_tokens=10, sampling=SamplingOptions(logit_bias={eos: 100.0}))
    tokens, finish, _ = _run(core)
    assert len(tokens["m"]) == 11 and tokens["m"][-1] == eos and finish["m"] == "stop"


def test_same_seed_same_constrained_output() -> None:
    guided = GuidedDecoding(json={"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]})
    first = [text for text, _ in _generate(guided, 3, seed=11)]
    again = [text for text, _ in _generate(guided, 3, seed=11)]
    assert first == again
