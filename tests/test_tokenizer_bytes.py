"""The built-in tiny tokenizer covers any text: every string encodes and decodes to itself.

Property tests over arbitrary Unicode (hypothesis), on the tokenizer as built and as a
checkpoint reloads it (a qwen2 model folder + tokenizer, loaded by ``load_tokenizer`` as the
workers, the driver and the warm-start cache do; ``AutoTokenizer`` would rebuild it as
Qwen2's tokenizer, whose decoder prints byte tokens as ``<0x41>``).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from asyncflow.engines.tiny import CHARSET, build_char_tokenizer, build_tiny_model
from asyncflow.tasks.models import load_model

TOK = build_char_tokenizer()


@pytest.fixture(scope="module")
def reloaded(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("ckpt")
    build_tiny_model(TOK, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64
                     ).save_pretrained(d)
    TOK.save_pretrained(d)
    return load_model(d)[1]


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_any_unicode_round_trips(s: str) -> None:
    ids = TOK(s, add_special_tokens=False).input_ids
    assert TOK.unk_token_id not in ids
    assert TOK.decode(ids) == s
    assert TOK.decode(ids, skip_special_tokens=True) == s  # no text ever becomes a special token
    # one token per CHARSET character, one per UTF-8 byte of any other
    assert len(ids) == sum(1 if c in CHARSET else len(c.encode()) for c in s)


@settings(max_examples=100, deadline=None)
@given(st.text())
def test_reloaded_checkpoint_tokenizer_round_trips(reloaded, s: str) -> None:
    ids = reloaded(s, add_special_tokens=False).input_ids
    assert ids == TOK(s, add_special_tokens=False).input_ids
    assert reloaded.decode(ids, skip_special_tokens=True) == s


def test_issue_examples_keep_every_character() -> None:
    # the characters the old tokenizer dropped (issue 23): '>', uppercase, '!'
    for s in ("abcd>", "ABcd=", "a b!", "<eos>", "Grüße, 世界 🙂"):
        assert TOK.decode(TOK(s).input_ids, skip_special_tokens=True) == s
    # the addition task's characters keep one id each, in CHARSET order
    assert TOK("12+34=").input_ids == [5, 6, 14, 7, 8, 18]


def test_invalid_generated_bytes_decode_to_replacement_char() -> None:
    lone = TOK.convert_tokens_to_ids("<0xC3>")  # the first byte of 'é' alone
    assert TOK.decode([lone]) == "\ufffd"
