"""Plain prompts carry the start the tokenizer itself puts before text (Gemma's `<bos>`), since every prompt is encoded
without special tokens; tokenizers that add none, and chat templates, get nothing added."""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from components.config import PromptConfig
from components.engine.models.prompting import PromptFormatter


def character_tokenizer(adds_bos: bool) -> PreTrainedTokenizerFast:
    """A tokenizer over digits and '+=' whose post-processor adds `<bos>` to plain text as Gemma's does, or nothing."""
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{c: i + 3 for i, c in enumerate("0123456789+=")}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    if adds_bos:
        core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


def test_a_plain_prompt_starts_as_the_tokenizer_starts_plain_text():
    gemma_like, plain = character_tokenizer(adds_bos=True), character_tokenizer(adds_bos=False)
    cfg = PromptConfig(template="{prompt}", chat_template="never")
    text = PromptFormatter(cfg, gemma_like)({"prompt": "12+7="})
    assert text == "<bos>12+7="
    # encoded as the pipeline encodes prompts, it is what the tokenizer makes of the bare text
    encoded = gemma_like(text, add_special_tokens=False).input_ids
    assert encoded == gemma_like("12+7=").input_ids == [2, 4, 5, 13, 10, 14]
    assert PromptFormatter(cfg, plain)({"prompt": "12+7="}) == "12+7="
    assert PromptFormatter(cfg, gemma_like).settings()["start"] == "<bos>"  # the served model formats the same


def test_the_served_model_formats_with_trainings_own_rendering():
    """The served model renders a prompt with the file it ships (`prompt_text`) and the formatter's settings: the
    same text as training's formatter, plain (with the tokenizer's start and a system line) and through a chat
    template; and it keeps no rendering of its own."""
    import inspect

    from components.engine.models import prompt_text
    from components.tracking.serving_model import CompletionModel

    chat = character_tokenizer(adds_bos=False)
    chat.chat_template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}[assistant]"
    cases = [(PromptConfig(template="{prompt}", chat_template="never"), character_tokenizer(adds_bos=True)),
             (PromptConfig(template="Q: {prompt}", system="Add.", chat_template="never"), chat),
             (PromptConfig(template="Q: {prompt}", system="Add.", chat_template="always"), chat)]
    for cfg, tokenizer in cases:
        formatter = PromptFormatter(cfg, tokenizer)
        served = CompletionModel()
        served.prompt_text, served.tokenizer = prompt_text, tokenizer
        for key, value in formatter.settings().items():
            setattr(served, key, value)
        record = {"prompt": "12+7=", "answer": "19"}
        assert served.format(record) == formatter(record), cfg
    assert formatter(record) == "[system]Add.[user]Q: 12+7=[assistant]"
    source = inspect.getsource(CompletionModel.format)
    assert "apply_chat_template(messages" not in source and ".format(**" not in source


def test_token_counts_are_the_tokenizers_own_whatever_its_backend_was_left_set_to():
    """`token_counts` asks a fast tokenizer's backend directly only when that gives what `tokenizer(texts,
    add_special_tokens=False)` gives: counted by hand here, then with the backend left padding, truncating or
    encoding special tokens' text as text (each of which the direct call would count differently)."""
    from components.engine.models.prompting import token_counts

    tokenizer = character_tokenizer(adds_bos=True)
    texts = ["12+7=", "1", "<bos>3+4=", ""]
    assert token_counts(tokenizer, texts) == [5, 1, 5, 0]  # characters, `<bos>` one token, no added start
    backend = tokenizer.backend_tokenizer
    backend.enable_padding(length=8, pad_id=0, pad_token="<pad>")
    assert token_counts(tokenizer, texts) == [5, 1, 5, 0]
    backend.no_padding()
    backend.enable_truncation(max_length=2)
    assert token_counts(tokenizer, texts) == [5, 1, 5, 0]
    backend.no_truncation()
    tokenizer.split_special_tokens = True  # `<bos>` in the text is read as its five characters
    assert token_counts(tokenizer, texts) == [len(ids) for ids in tokenizer(texts, add_special_tokens=False).input_ids]
    assert token_counts(tokenizer, texts)[2] == 9
    assert token_counts(tokenizer, []) == []
