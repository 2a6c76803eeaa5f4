"""Chat: the template renders as transformers renders it; a conversation kept in the KV cache
gives the replies that generating from the whole rendered conversation gives (transformers),
while each turn prefills only its own new tokens."""

from __future__ import annotations

import pytest
import torch

from qkv.runtime import reusable_prefix

from qkv.chat.conversation import ChatModel, ChatSession, ChatTemplate, ReplySettings
from qkv.errors import QkvError
from qkv.util.long_text import long_text

smollm2 = pytest.mark.xdist_group("smollm2")

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Where is Lyon?"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Times ten, naïvely: 😀"},
    ],
]
GREEDY = ReplySettings(max_new_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def chat(smollm2_model, smollm2_checkpoint) -> ChatModel:
    model, tokenizer = smollm2_model
    ck = smollm2_checkpoint
    template = ChatTemplate(ck.chat_template, bos_token=ck.bos_token, eos_token=ck.eos_token)
    return ChatModel(model, tokenizer, template, frozenset({tokenizer.token_to_id(ck.eos_token)}))


@pytest.fixture
def session(chat: ChatModel):
    s = ChatSession(chat, max_context=512, seed=0)
    yield s
    s.close()


@smollm2
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_template_renders_like_transformers(smollm2_checkpoint, hf_smollm2_tokenizer, generation_prompt: bool) -> None:
    ck = smollm2_checkpoint
    template = ChatTemplate(ck.chat_template, bos_token=ck.bos_token, eos_token=ck.eos_token)
    for messages in CONVERSATIONS:
        expected = hf_smollm2_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
        assert template.render(messages, add_generation_prompt=generation_prompt) == expected


def test_template_features_transformers_offers() -> None:
    """raise_exception, loop controls and tojson work, inside a sandbox."""
    template = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
        "{% if loop.index > 1 %}{% break %}{% endif %}{{ bos_token }}{{ m | tojson }}{% endfor %}",
        bos_token="<s>",
    )
    assert template.render([{"role": "user", "content": "é"}, {"role": "user", "content": "x"}]) == (
        '<s>{"role": "user", "content": "é"}'
    )
    with pytest.raises(QkvError, match="no tools"):
        template.render([{"role": "tool", "content": "x"}])
    with pytest.raises(QkvError, match="does not parse"):
        ChatTemplate("{% for %}")
    with pytest.raises(QkvError, match="failed"):
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}").render([])


@smollm2
@pytest.mark.slow
def test_cached_conversation_replies_like_transformers_on_the_whole_text(
    session: ChatSession, chat: ChatModel, hf_smollm2_model
) -> None:
    tokenizer = chat.tokenizer
    first = session.reply("What is the capital of France?", GREEDY)
    cached_after_first = len(session.cached_ids)
    second = session.reply("And the capital of Italy?", GREEDY)

    # The cache kept the whole prefill parts of the history (qkv.runtime.reusable_prefix: what
    # a server prefilling the whole conversation writes too); only the rest went through prefill.
    rendered = chat.template.render(session.messages[:-1], add_generation_prompt=True)
    all_ids = tokenizer.encode(rendered, add_special_tokens=False).ids
    kept = len(all_ids) - session.last_prefill
    assert kept == reusable_prefix(len(all_ids), kept) and kept <= cached_after_first
    # What the cache holds is exactly the tokens of the rendered conversation.
    assert all_ids == session.cached_ids[: len(all_ids)]

    # The reference: transformers generating greedily from the whole rendered conversation.
    with torch.inference_mode():
        out = hf_smollm2_model.generate(
            torch.tensor([all_ids]), max_new_tokens=GREEDY.max_new_tokens, do_sample=False,
            eos_token_id=sorted(chat.stop_ids), pad_token_id=sorted(chat.stop_ids)[0],
        )[0, len(all_ids):].tolist()
    expected = tokenizer.decode([t for t in out if t not in chat.stop_ids], skip_special_tokens=False)
    assert first and second == expected
    assert session.messages[-1] == {"role": "assistant", "content": second}


@smollm2
def test_reset_forgets_the_conversation(session: ChatSession) -> None:
    few = ReplySettings(max_new_tokens=6, temperature=0.0)
    first = session.reply("Name a colour.", few)
    session.reply("Another one?", few)
    session.reset()
    assert session.cached_ids == [] and (session.session is None or session.session.cache_length() == 0)
    assert session.messages == []
    assert session.reply("Name a colour.", few) == first


@smollm2
def test_rewritten_history_is_prefilled_again(session: ChatSession) -> None:
    few = ReplySettings(max_new_tokens=4, temperature=0.0)
    session.reply("Say one word.", few)
    session.messages[-1]["content"] = "Edited reply."  # no longer what the cache holds
    session.reply("Thanks.", few)
    rendered = session.chat.template.render(session.messages[:-1], add_generation_prompt=True)
    all_ids = session.chat.tokenizer.encode(rendered, add_special_tokens=False).ids
    assert session.last_prefill == len(all_ids)
    assert session.cached_ids[: len(all_ids)] == all_ids


@smollm2
def test_stopping_a_reply_early_keeps_it(session: ChatSession) -> None:
    tokens = session.send("Count from one to ten.", ReplySettings(max_new_tokens=20, temperature=0.0))
    kept = [next(tokens), next(tokens), next(tokens)]
    tokens.close()
    assert session.messages[-1]["content"] == session.chat.tokenizer.decode(kept, skip_special_tokens=False)


@smollm2
def test_a_conversation_longer_than_the_context_streams_through_a_sink_cache(chat: ChatModel) -> None:
    notices: list[str] = []
    session = ChatSession(chat, max_context=128, system="Be brief.", notice=notices.append)
    try:
        text = long_text()[:900] + "\nWhat is this about?"  # about 230 tokens
        first = session.reply(text, ReplySettings(max_new_tokens=8, temperature=0.0))
        assert session.streaming and len(notices) == 1 and "outgrew the 128-token context" in notices[0]
        second = session.reply("Say it in one word.", ReplySettings(max_new_tokens=8, temperature=0.0))
        assert first and second
        assert len(notices) == 1  # said once
        assert len(session.cached_ids) > 128  # the conversation went on past the context
        session.reset()
        assert not session.streaming and session.session is None
        # A fresh conversation that fits is the full cache's again.
        fits = ChatSession(chat, max_context=512, system="Be brief.")
        try:
            assert session.reply("Hi!", GREEDY) == fits.reply("Hi!", GREEDY)
        finally:
            fits.close()
    finally:
        session.close()


def test_a_model_without_rope_refuses_a_conversation_longer_than_the_context(tmp_path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from qkv.models.gpt2 import GPT2Decoder
    from qkv.models.configs.gpt2 import GPTConfig

    vocab = {w: i for i, w in enumerate(["<eos>", "word", "user", "assistant", ":", "Be", "brief."])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    torch.manual_seed(0)
    model = GPT2Decoder(GPTConfig(vocab_size=len(vocab), context_length=64, emb_dim=16, n_heads=2, n_layers=1))
    template = ChatTemplate("{% for m in messages %}{{ m.role }}: {{ m.content }} {% endfor %}"
                            "{% if add_generation_prompt %}assistant: {% endif %}")
    session = ChatSession(ChatModel(model.eval(), tokenizer, template, frozenset({0})), max_context=64,
                          system="Be brief.")
    try:
        with pytest.raises(QkvError, match="context holds 64.*/reset"):
            session.send("word " * 80, ReplySettings(max_new_tokens=4))
        assert session.messages == [{"role": "system", "content": "Be brief."}]
        assert session.cached_ids == []
    finally:
        session.close()
