"""Chat prompts on the llama engine: a GGUF's own template (``tokenizer.chat_template``) applied
by llama.cpp, its end-of-turn tokens, ``shard-engine run --chat`` end to end, and the refusals
(no template, a template llama.cpp does not know, bad messages)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from gguf_edit import array, rewrite

import shard_engine_api as api
from shard_engine_api import ChatMessage, ChatTokenizer, InvalidRequest, UnsupportedFeature
from shard_engine_api.cli import main
from shard_engine_llama._gguf import MetadataValue, read_gguf_header
from shard_engine_llama._tiny_model import write_tiny_model

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""The chatml template as Qwen's GGUFs store it; llama.cpp recognises it by <|im_start|>."""

_STRING = gguf.GGUFValueType.STRING
_VOCAB = 262  # two word pieces become <|im_start|> and <|im_end|>
IM_START, IM_END = _VOCAB - 2, _VOCAB - 1
EOS = 2


def _chat_model(
    directory: Path, name: str, *, template: str | None = CHATML, eos: int = EOS
) -> Path:
    """A generated 2-layer llama GGUF whose last two tokens are chatml's control tokens, with
    ``template`` as its tokenizer.chat_template (None: no template) and ``eos`` as its EOS."""
    base = directory / "base.gguf"
    if not base.exists():
        write_tiny_model(base, n_layers=2, vocab=_VOCAB, seed=3)
    header = read_gguf_header(base)
    tokens = list(header.metadata["tokenizer.ggml.tokens"].value)  # type: ignore[arg-type]
    types = list(header.metadata["tokenizer.ggml.token_type"].value)  # type: ignore[arg-type]
    tokens[IM_START], tokens[IM_END] = "<|im_start|>", "<|im_end|>"
    types[IM_START] = types[IM_END] = int(gguf.TokenType.CONTROL)
    metadata: dict[str, MetadataValue | None] = {
        "tokenizer.ggml.tokens": array(tokens, _STRING),
        "tokenizer.ggml.token_type": array(types, gguf.GGUFValueType.INT32),
        "tokenizer.ggml.eos_token_id": MetadataValue(eos, gguf.GGUFValueType.UINT32),
        "tokenizer.chat_template": None if template is None else MetadataValue(template, _STRING),
    }
    return rewrite(base, directory / name, metadata=metadata)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chat")


def _chat_tokenizer(model: Path) -> ChatTokenizer:
    found = api.load_tokenizer("llama", str(model))
    assert isinstance(found, ChatTokenizer)
    return found


def test_the_chatml_template_as_llama_cpp_writes_it(models: Path) -> None:
    """One user message: chatml's exact text with the assistant's turn opened; its markers are
    the model's control tokens, and <|im_end|> (with EOS) ends the turn."""
    tokenizer = _chat_tokenizer(_chat_model(models, "chatml.gguf"))
    user = [ChatMessage(role="user", content="Hello there")]
    assert tokenizer.apply_chat_template(user) == (
        "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    )
    conversation = [
        ChatMessage(role="system", content="Be brief."),
        *user,
        ChatMessage(role="assistant", content="Hi."),
        ChatMessage(role="user", content="Bye"),
    ]
    assert tokenizer.apply_chat_template(conversation) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n"
        "<|im_start|>assistant\nHi.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer.encode_chat(user)
    assert ids[0] == IM_START
    assert ids.count(IM_START) == 2
    assert ids.count(IM_END) == 1
    assert ids[: ids.index(IM_END)].count(IM_START) == 1
    # Between the markers, the text as llama.cpp's SentencePiece tokenizer spells it (a
    # leading U+2581 for the space it prefixes; this vocabulary spells it in bytes).
    between = tokenizer.decode(ids[1 : ids.index(IM_END)])
    assert between.replace("\u2581", " ") == " user\nHello there"
    assert tokenizer.end_of_turn_tokens() == (EOS, IM_END)
    # Plain encode still spells the markers out as text.
    assert IM_START not in tokenizer.encode("<|im_start|>")


def test_a_model_without_a_template_is_unsupported(models: Path) -> None:
    tokenizer = _chat_tokenizer(_chat_model(models, "plain.gguf", template=None))
    user = [ChatMessage(role="user", content="Hello")]
    for call in (
        lambda: tokenizer.apply_chat_template(user),
        lambda: tokenizer.encode_chat(user),
        tokenizer.end_of_turn_tokens,
    ):
        with pytest.raises(UnsupportedFeature, match=r"plain\.gguf has no chat template"):
            call()
    assert tokenizer.encode("Hello")  # the tokenizer itself still works


def test_a_template_llama_cpp_does_not_recognise_is_unsupported(models: Path) -> None:
    tokenizer = _chat_tokenizer(_chat_model(models, "odd.gguf", template="{{ messages | tojson }}"))
    with pytest.raises(UnsupportedFeature, match="does not recognise this model's chat template"):
        tokenizer.apply_chat_template([ChatMessage(role="user", content="Hello")])


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "non-empty sequence of ChatMessage"),
        ("hello", "non-empty sequence of ChatMessage"),
        ([{"role": "user", "content": "x"}], "must be a ChatMessage"),
        ([ChatMessage(role="user", content="a\x00b")], "content holds a NUL"),
        ([ChatMessage(role="user", content="\udc80")], "content is not valid UTF-8"),
        ([ChatMessage(role=1, content="x")], "role must be a str"),  # type: ignore[arg-type]
    ],
)
def test_bad_messages_are_invalid_requests(models: Path, messages: object, message: str) -> None:
    tokenizer = _chat_tokenizer(_chat_model(models, "chatml.gguf"))
    with pytest.raises(InvalidRequest, match=message):
        tokenizer.apply_chat_template(messages)  # type: ignore[arg-type]


def _run_json(capsys: pytest.CaptureFixture[str], *arguments: str) -> dict[str, object]:
    assert main(["run", "--engine", "llama", "--shards", "2", "--json", *arguments]) == 0
    document: dict[str, object] = json.loads(capsys.readouterr().out)
    return document


def test_run_chat_end_to_end(
    models: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`run --chat`: the prompt ids are the templated text's, the split is verified, and the
    generation stops at an end-of-turn token (here the model's EOS, moved to the third token
    the random model draws, so the same weights stop after two)."""
    monkeypatch.setenv("SHARD_ENGINE_MODEL_STORE", str(models / "store"))
    model = _chat_model(models, "chatml.gguf")
    arguments = ("--model", str(model), "--chat", "--prompt", "Hello there")
    free = _run_json(capsys, *arguments, "--max-new-tokens", "6")
    expected = _chat_tokenizer(model).encode_chat([ChatMessage(role="user", content="Hello there")])
    assert free["prompt_ids"] == expected
    assert free["chat"] is True
    assert free["verify"]["passed"] is True  # type: ignore[index]
    generated = free["token_ids"]
    assert isinstance(generated, list)
    assert len(generated) == 6
    assert free["finish_reason"] == "length"
    # A token the model draws third (and not before) becomes its EOS: the turn ends there.
    stop_at = next(i for i, token in enumerate(generated) if i and token not in generated[:i])
    stopping = _chat_model(models, "stops.gguf", eos=generated[stop_at])
    stopped = _run_json(capsys, "--model", str(stopping), *arguments[2:], "--max-new-tokens", "6")
    assert stopped["token_ids"] == generated[:stop_at]
    assert stopped["finish_reason"] == "stop"
    assert stopped["verify"]["passed"] is True  # type: ignore[index]
    # Without --chat the same model runs the plain prompt.
    plain = _run_json(capsys, "--model", str(model), "--prompt", "Hello there", "--no-verify")
    assert plain["prompt_ids"] == _chat_tokenizer(model).encode("Hello there")
    assert plain["chat"] is False


def test_run_chat_on_a_model_without_a_template_fails_before_loading(
    models: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from shard_engine_llama import LlamaEngine

    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("a shard was loaded")

    monkeypatch.setattr(LlamaEngine, "load", no_loading)
    model = _chat_model(models, "plain.gguf", template=None)
    arguments = ["run", "--engine", "llama", "--model", str(model), "--shards", "2", "--chat"]
    assert main(arguments) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip().splitlines() == [
        "shard-engine run: UnsupportedFeature [unsupported_feature]: plain.gguf has no chat "
        "template (no tokenizer.chat_template in its GGUF metadata)"
    ]


def test_run_chat_with_sessions_templates_each_prompt(
    models: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`run --chat --sessions 2`: each session's prompt ('<prompt> #i') is its own user turn."""
    monkeypatch.setenv("SHARD_ENGINE_MODEL_STORE", str(models / "store"))
    model = _chat_model(models, "chatml.gguf")
    document = _run_json(
        capsys, "--model", str(model), "--chat", "--prompt", "Hi", "--sessions", "2",
        "--max-new-tokens", "3",
    )  # fmt: skip
    tokenizer = _chat_tokenizer(model)
    assert [session["prompt_ids"] for session in document["sessions"]] == [  # type: ignore[attr-defined]
        tokenizer.encode_chat([ChatMessage(role="user", content=f"Hi #{number}")])
        for number in (1, 2)
    ]
    assert document["verify"]["passed"] is True  # type: ignore[index]
