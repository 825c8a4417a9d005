"""Each vocabulary token's own bytes, as logprobs report them (OpenAI's `bytes`).

A token's decoded text is not its bytes: a byte-level BPE piece can hold part of a UTF-8
character (SmolLM2's "ĠðŁĺ" is a space and the first three bytes of an emoji, and decodes on
its own to " �"), so encoding the text would give the replacement character's bytes. The bytes
come from the vocabulary instead, by the tokenizer's own byte mapping:
- byte-level BPE (GPT-2's scheme, the `ByteLevel` decoder): each character of the piece stands
  for one byte, through GPT-2's table of 256 printable characters;
- SentencePiece-style pieces (a `ByteFallback` or `Metaspace` decoder): "<0xE2>" is that byte,
  "▁" a space, any other character its UTF-8;
- added tokens ("<|im_end|>"): their text's UTF-8;
- any other tokenizer: the UTF-8 of the token decoded alone (right for whole characters).
The tokenizer's kind is read once, at its first use; each token's bytes once, when first asked
for.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections.abc import Callable
from typing import Any

# SentencePiece's stand-in for a space, and its pieces that are one raw byte.
_SPACE_MARK = "\u2581"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: each byte's printable character in byte-level BPE pieces.

    Printable Latin-1 bytes stand for themselves; the other 68 (control characters, space,
    and a few more) are shifted to U+0100 and up, in byte order.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + shifted)
            shifted += 1
    return table


_BYTE_OF_CHAR = {char: byte for byte, char in bytes_to_unicode().items()}


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The token's bytes (`token_id:N` as UTF-8 for a model without a tokenizer)."""
    if tokenizer is None:
        return f"token_id:{token_id}".encode()
    vocabulary = _vocabularies.get(tokenizer)
    if vocabulary is None:
        with _lock:  # one thread reads a tokenizer's kind; the others wait for it
            vocabulary = _vocabularies.get(tokenizer)
            if vocabulary is None:
                vocabulary = _vocabularies[tokenizer] = _Vocabulary(tokenizer)
    return vocabulary.bytes_of(token_id)


class _Vocabulary:
    """One tokenizer's mapping, read once, and the bytes of each token asked for so far
    (logprobs with 20 alternatives name 21 tokens per generated token, mostly the same few
    thousand)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.read_piece = _piece_reader(tokenizer)
        self.added = {
            token_id: str(getattr(token, "content", token))
            for token_id, token in getattr(tokenizer, "added_tokens_decoder", {}).items()
        }
        # Racing threads may both read a token; same result.
        self.known: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        known = self.known.get(token_id)
        if known is None:
            known = self.known[token_id] = self._read(token_id)
        return known

    def _read(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode()
        if self.read_piece is not None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            raw = self.read_piece(piece) if isinstance(piece, str) else None
            if raw is not None:
                return raw
        return str(self.tokenizer.decode([token_id])).encode()


def _piece_reader(tokenizer: Any) -> Callable[[str], bytes | None] | None:
    """How to read a vocabulary piece as bytes for this tokenizer (None: decode each token)."""
    decoder = _decoder_types(tokenizer)
    if "ByteLevel" in decoder:
        return _byte_level_bytes
    if "ByteFallback" in decoder or "Metaspace" in decoder:
        return _sentencepiece_bytes
    return None


def _decoder_types(tokenizer: Any) -> set[str]:
    """The types of the fast tokenizer's decoder and of those it chains (empty for others)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except (ValueError, AttributeError):
        return set()
    types = {str(decoder.get("type"))}
    types.update(str(part.get("type")) for part in decoder.get("decoders") or [])
    return types


def _byte_level_bytes(piece: str) -> bytes | None:
    """A byte-level BPE piece's bytes (None: a character outside GPT-2's table)."""
    try:
        return bytes(_BYTE_OF_CHAR[char] for char in piece)
    except KeyError:  # not a byte-level piece after all: decode it instead
        return None


def _sentencepiece_bytes(piece: str) -> bytes | None:
    """A SentencePiece-style piece's bytes."""
    byte = _BYTE_PIECE.fullmatch(piece)
    if byte is not None:
        return bytes([int(byte.group(1), 16)])
    return piece.replace(_SPACE_MARK, " ").encode()


_vocabularies: weakref.WeakKeyDictionary[Any, _Vocabulary] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
