"""Logprobs' `bytes` are each token's own bytes from the vocabulary, not the UTF-8 of its
decoded text: right for a token that holds part of a character, for byte-level BPE pieces
(SmolLM2's) and for SentencePiece-style byte pieces."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from engine.sampling.token_bytes import bytes_to_unicode, token_bytes

TEXT = " the café 😀 naïve"


def test_gpt2_byte_table_maps_all_256_bytes_to_distinct_printable_characters() -> None:
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256))
    assert len(set(table.values())) == 256
    assert table[ord(" ")] == "Ġ" and table[ord("A")] == "A"


def test_byte_level_tokens_carry_their_own_bytes(smollm2_tokenizer: Any) -> None:
    ids = smollm2_tokenizer.encode(TEXT, add_special_tokens=False)
    pieces = [token_bytes(smollm2_tokenizer, token) for token in ids]
    # The emoji (F0 9F 98 80) is split over two tokens, neither of which decodes alone.
    assert pieces == [b" the", b" caf\xc3\xa9", b" \xf0\x9f\x98", b"\x80", b" na", b"\xc3\xafve"]
    assert smollm2_tokenizer.decode([ids[3]]) == "\ufffd"


def test_whole_tokens_bytes_are_their_text_and_special_tokens_their_name(
    smollm2_tokenizer: Any,
) -> None:
    for token in smollm2_tokenizer.encode(" Paris is the capital", add_special_tokens=False):
        assert token_bytes(smollm2_tokenizer, token) == smollm2_tokenizer.decode([token]).encode()
    end = smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert token_bytes(smollm2_tokenizer, end) == b"<|im_end|>"


def sentencepiece_style_tokenizer() -> PreTrainedTokenizerFast:
    """A tiny Llama-2-style vocabulary: "▁" for spaces, and byte pieces for what it lacks."""
    vocab = {"<unk>": 0, "<0xC3>": 1, "<0xA9>": 2, "▁caf": 3, "▁the": 4, "é": 5}
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_sentencepiece_byte_pieces_are_one_byte_and_spaces_are_spaces() -> None:
    tokenizer = sentencepiece_style_tokenizer()
    assert [token_bytes(tokenizer, token) for token in (1, 2, 3, 4, 5)] == [
        b"\xc3",
        b"\xa9",
        b" caf",
        b" the",
        "é".encode(),
    ]


def test_a_model_without_a_tokenizer_names_tokens_by_id() -> None:
    assert token_bytes(None, 42) == b"token_id:42"
