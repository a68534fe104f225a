"""The llama plugin's tokenizer, as worker code loads it (``load_tokenizer("llama", path)``):
a file is validated before llama.cpp's vocabulary loader sees it, which aborts the process on
some malformed vocabularies; bad files and bad arguments are typed errors.

Every load of a hostile file runs in a child process, so a regression aborts the child, not
the test run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import gguf
import pytest
from gguf_edit import array, rewrite, u32

from shard_engine_api import InvalidRequest, load_tokenizer
from shard_engine_llama._gguf import MetadataValue, read_gguf_header, split_model
from shard_engine_llama.plugin import ENCODE_BYTES_PER_TOKEN, MIN_ENCODE_CONTEXT, max_encode_bytes

_STRING = gguf.GGUFValueType.STRING

_CHILD = """
import json, sys
import shard_engine_api as api
try:
    found = api.load_tokenizer("llama", sys.argv[1])
except api.ShardEngineError as error:
    print(json.dumps({"error": type(error).__name__, "details": error.details}))
else:
    print(json.dumps({"loaded": found is not None}))
"""


def _load_in_child(path: Path) -> dict[str, object]:
    """What ``load_tokenizer`` gives for ``path`` in a fresh process (which must exit 0)."""
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        # ggml's abort handler would attach gdb for a backtrace.
        env={**os.environ, "GGML_NO_BACKTRACE": "1"},
        check=False,
    )
    assert done.returncode == 0, f"load_tokenizer({path.name}) died: {done.returncode}"
    answer: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


def _tokens(model: Path) -> list[str]:
    return list(read_gguf_header(model).metadata["tokenizer.ggml.tokens"].value)  # type: ignore[arg-type]


def _types(model: Path) -> list[int]:
    return list(read_gguf_header(model).metadata["tokenizer.ggml.token_type"].value)  # type: ignore[arg-type]


def _duplicate_empty(model: Path, tokens: list[str]) -> None:
    # llama.cpp names an empty token i "[EMPTY_i]": a second token of that text made
    # GGML_ASSERT(id_to_token.size() == token_to_id.size()) abort the process.
    tokens[10], tokens[11] = "", "[EMPTY_10]"


def _plain_duplicate(model: Path, tokens: list[str]) -> None:
    tokens[12] = tokens[13]


def _byte_token_without_its_byte(model: Path, tokens: list[str]) -> None:
    tokens[_types(model).index(6)] = "<x"


@pytest.mark.parametrize(
    ("name", "edit", "rule"),
    [
        ("empty-renamed-duplicate", _duplicate_empty, "vocabulary-duplicate-tokens"),
        ("plain-duplicate", _plain_duplicate, "vocabulary-duplicate-tokens"),
        ("byte-token", _byte_token_without_its_byte, "vocabulary-byte-token"),
    ],
)
def test_a_hostile_vocabulary_is_refused_before_llama_cpp_reads_it(
    tiny_model: Path, tmp_path: Path, name: str, edit: object, rule: str
) -> None:
    tokens = _tokens(tiny_model)
    edit(tiny_model, tokens)  # type: ignore[operator]
    broken = rewrite(
        tiny_model,
        tmp_path / f"{name}.gguf",
        metadata={"tokenizer.ggml.tokens": array(tokens, _STRING)},
    )
    answer = _load_in_child(broken)
    assert answer["error"] == "InvalidRequest"
    assert answer["details"] == {"rule": rule, "field": "tokenizer.ggml.tokens"}


def test_special_token_ids_out_of_range_are_refused(tiny_model: Path, tmp_path: Path) -> None:
    n_tokens = len(_tokens(tiny_model))
    broken = rewrite(
        tiny_model,
        tmp_path / "eos.gguf",
        metadata={"tokenizer.ggml.eos_token_id": u32(n_tokens + 5)},
    )
    answer = _load_in_child(broken)
    assert answer["error"] == "InvalidRequest"
    assert isinstance(answer["details"], dict)
    assert answer["details"]["field"] == "tokenizer.ggml.eos_token_id"


def test_damaged_files_are_typed_errors(tiny_model: Path, tmp_path: Path) -> None:
    raw = tiny_model.read_bytes()
    cases = {
        "truncated-header.gguf": raw[:200],
        "truncated-data.gguf": raw[: len(raw) // 2],
        "not-gguf.gguf": b"PK\x03\x04" + raw[4:],
        "empty.gguf": b"",
    }
    for name, content in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        answer = _load_in_child(path)
        assert answer.get("error") == "InvalidRequest", (name, answer)


def test_a_shard_file_has_no_tokenizer(tiny_model: Path, tmp_path: Path) -> None:
    manifest = split_model(tiny_model, [(0, 3), (3, 6)], tmp_path / "shards")
    assert _load_in_child(manifest.shard_path(1)) == {"loaded": False}
    assert _load_in_child(tiny_model) == {"loaded": True}


def test_paths_that_are_not_model_files_are_invalid(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    for model in (str(tmp_path / "missing.gguf"), str(tmp_path), "/dev/null", str(fifo), "a\0b"):
        with pytest.raises(InvalidRequest):
            load_tokenizer("llama", model)


def test_encode_and_decode_take_text_and_ids_of_the_vocabulary(tiny_model: Path) -> None:
    tokenizer = load_tokenizer("llama", str(tiny_model))
    assert tokenizer is not None
    ids = tokenizer.encode("hello")
    assert ids
    assert "hello" in tokenizer.decode(ids)
    n_vocab = len(_tokens(tiny_model))
    for bad in ([-1], [n_vocab], [2**40], [1.0], [True], ["a"], [None]):
        with pytest.raises(InvalidRequest, match="not an id of this vocabulary"):
            tokenizer.decode(bad)  # type: ignore[arg-type]
    for text in (b"hello", None, 5):
        with pytest.raises(InvalidRequest, match="must be a str"):
            tokenizer.encode(text)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="not valid UTF-8"):
        tokenizer.encode("ab\udcffcd")


def test_text_longer_than_the_models_context_can_hold_is_refused_at_once(
    tiny_model: Path,
) -> None:
    """llama.cpp's tokenizer costs time in the square of the tokens it falls back to bytes
    for (1 MB of text: minutes): text beyond what the model's context could hold
    (``max_encode_bytes``) is InvalidRequest before llama.cpp sees it, in characters or, for
    multi-byte text, in bytes; text up to the limit is still encoded."""
    tokenizer = load_tokenizer("llama", str(tiny_model))
    assert tokenizer is not None
    limit = max_encode_bytes(read_gguf_header(tiny_model).get_int("llama.context_length"))
    assert limit == MIN_ENCODE_CONTEXT * ENCODE_BYTES_PER_TOKEN  # the tiny model's is 512
    started = time.monotonic()
    for text in ("a" * 1_000_000, "\u2581" * (limit // 3 + 1), " " * (limit + 1)):
        with pytest.raises(InvalidRequest, match="at most") as refused:
            tokenizer.encode(text)
        assert refused.value.details["limit_bytes"] == limit
    assert time.monotonic() - started < 1.0
    assert len(tokenizer.encode("ab " * (limit // 3))) >= limit // 3


_ENCODE_CHILD = """
import json, sys
import shard_engine_api as api
texts = json.loads(sys.argv[1])
outcomes = {}
for path in sys.argv[2:]:
    try:
        tokenizer = api.load_tokenizer("llama", path)
    except api.ShardEngineError as error:
        outcomes[path] = {"error": type(error).__name__, "details": error.details}
        continue
    encoded = 0
    for text in texts:
        try:
            tokenizer.encode(text)
            encoded += 1
        except api.InvalidRequest:
            pass  # refused text is a typed outcome too
    outcomes[path] = {"encoded": encoded}
print(json.dumps(outcomes))
"""
# Runs of spaces, tabs, newlines and other whitespace, where pieces could keep a raw space.
_WHITESPACE_TEXTS = (
    "a  b",
    "  ",
    "a \t b",
    "x   y\n\n  z",
    " leading",
    "trailing  ",
    "Hello  world",
    "\u3000\u3000 \u00a0 a",
    "1  2   3",
)


def test_no_accepted_bpe_pre_tokenizer_aborts_on_whitespace_runs(tmp_path: Path) -> None:
    """llama.cpp's BPE merges assert that no piece holds a space; the "whitespace"
    pre-tokenizer hands them runs of spaces, and encoding "a  b" aborted the process (SIGABRT
    in find_bpe_rank). It is refused when the file is loaded; every other pre-tokenizer
    llama.cpp knows is accepted and encodes whitespace runs without aborting (one child
    process runs them all and must exit 0)."""
    from shard_engine_llama._gguf.tokenizer_checks import _BPE_PRE_TOKENIZERS
    from shard_engine_llama._gguf.validation import _BYTE_LEVEL
    from shard_engine_llama._tiny_model import write_tiny_model

    source = tmp_path / "source.gguf"
    write_tiny_model(source, n_layers=1)
    spaces = _BYTE_LEVEL[0x20] * 2
    tokens = [_BYTE_LEVEL[byte] for byte in range(256)] + ["He", "<s>", "</s>", spaces]
    paths: dict[str, Path] = {}
    for index, pre in enumerate(sorted(_BPE_PRE_TOKENIZERS)):
        paths[pre] = rewrite(
            source,
            tmp_path / f"pre-{index}.gguf",
            metadata={
                "tokenizer.ggml.model": MetadataValue("gpt2", _STRING),
                "tokenizer.ggml.pre": MetadataValue(pre, _STRING),
                "tokenizer.ggml.tokens": array(tokens, _STRING),
                "tokenizer.ggml.scores": None,
                "tokenizer.ggml.token_type": array([1] * len(tokens), gguf.GGUFValueType.INT32),
                # A merge of two spaces (and of two U+2581), so the runs reach find_bpe_rank.
                "tokenizer.ggml.merges": array(
                    ["H e", f"{spaces[0]} {spaces[1]}", "\u2581 \u2581"], _STRING
                ),
                "tokenizer.ggml.bos_token_id": u32(257),
                "tokenizer.ggml.eos_token_id": u32(258),
                "tokenizer.ggml.unknown_token_id": None,
            },
        )
    done = subprocess.run(
        [sys.executable, "-c", _ENCODE_CHILD, json.dumps(_WHITESPACE_TEXTS)]
        + [str(path) for path in paths.values()],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "GGML_NO_BACKTRACE": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    outcomes = json.loads(done.stdout.strip().splitlines()[-1])
    whitespace = paths.pop("whitespace")
    assert outcomes.pop(str(whitespace)) == {
        "error": "InvalidRequest",
        "details": {"rule": "tokenizer-pre", "field": "tokenizer.ggml.pre"},
    }
    assert len(outcomes) == len(paths) > 80
    # These escape spaces to U+2581 before merging, raw UTF-8 that this byte-level vocabulary
    # has no tokens for: the plugin refuses their texts (typed) after llama.cpp tokenized them.
    escaping = {"gemma4", "granite-embed-multi-311m", "sarvam-moe"}
    for pre, path in paths.items():
        outcome = outcomes[str(path)]
        assert "encoded" in outcome, (pre, outcome)
        if pre not in escaping:
            assert outcome["encoded"] == len(_WHITESPACE_TEXTS), (pre, outcome)
    # What the refusal prevents: llama.cpp itself, handed the file, aborts on "a  b".
    unchecked = (
        "import sys; from shard_engine_llama._abi import Vocabulary; "
        "Vocabulary(sys.argv[1]).tokenize('a  b')"
    )
    raw = subprocess.run(
        [sys.executable, "-c", unchecked, str(whitespace)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "GGML_NO_BACKTRACE": "1"},
        check=False,
    )
    assert raw.returncode == -signal.SIGABRT, (raw.returncode, raw.stderr[-500:])
    assert "find(' ')" in raw.stderr
