"""The token-fidelity rule of agent episodes (services/sampler/agents/tokens.py), checked by token ids.

The tiny model's real tokenizer and chat template; a Qwen3-style template (written here) for the prefix break:
like Qwen3's, it drops the ``<think>`` block of answers before the last user message and renders tool results
as user turns that do not count as a new query. "Sampled" completions are built one character per token,
which is not how the tokenizer would encode their text, so a prompt that re-tokenised the returned text
instead of keeping the sampled ids would differ from the expected ids.
"""

from __future__ import annotations

from typing import Any

import pytest

from services.common.prompts import token_ids
from services.common.tiny_model import CHAT_TEMPLATE, TinyModelSpec, build_tokenizer, qwen2_config
from services.sampler.agents.tokens import (
    ChatRenderer,
    EpisodeTokens,
    MessageError,
    MessagesDoNotExtend,
    PrefixRule,
    TurnPrompt,
    extension,
    group_prompt,
)
from services.sampler.engine import TokenDelta
from services.sampler.groups import Response

QWEN3_STYLE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set content = m.content %}"
    "{%- if loop.index0 < ns.last_query and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- for call in m.tool_calls or [] %}"
    '{{- \'<tool_call>\\n{"name": "\' + call.function.name + \'", "arguments": \' }}'
    "{{- call.function.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "evaluate an arithmetic expression",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
TAIL_AFTER_ANSWER = "<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny model's tokenizer loaded as the sampler loads it (``AutoTokenizer`` on a qwen2 directory gives
    ``Qwen2Tokenizer``), from a directory holding only its tokenizer files and config: the weights, which
    take seconds to build, play no part here."""
    from transformers import AutoTokenizer

    model_dir = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tokenizer().save_pretrained(model_dir)
    qwen2_config(TinyModelSpec()).save_pretrained(model_dir)
    return AutoTokenizer.from_pretrained(model_dir)


def sampled(tok: Any, text: str, eos: bool = True) -> list[int]:
    """Ids as a model may sample them: one token per character (not the tokenizer's encoding of the text)."""
    ids = [t for ch in text for t in tok.encode(ch, add_special_tokens=False)]
    assert ids != tok.encode(text, add_special_tokens=False), "the test needs a non-canonical split"
    return ids + ([tok.eos_token_id] if eos else [])


def enc(tok: Any, text: str) -> list[int]:
    return [int(t) for t in tok.encode(text, add_special_tokens=False)]


def test_splice_keeps_the_sampled_ids_and_eos_and_appends_only_the_template_tail(tok: Any) -> None:
    rule = PrefixRule(ChatRenderer(tok))
    assert rule.renderer.glue == "<|im_end|>\n"
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2 plus 2"}]
    first = rule.first_turn(messages)
    # the first prompt is what the sampler's PromptEncoder gives in-process episodes
    want = token_ids(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))
    assert first.ids == first.new_ids == want and first.break_reason is None
    completion = sampled(tok, "the sum is 4")  # stopped on EOS: <|im_end|> is the last sampled id
    context = first.ids + completion
    log = [*messages, {"role": "assistant", "content": "the sum is 4"}]
    turn = rule.next_turn(context, log, [*log, {"role": "user", "content": "add 3"}])

    assert turn.break_reason is None
    assert turn.ids[: len(context)] == context  # the model reads its own ids, EOS included
    # the glue's <|im_end|> is already the last sampled id: not written twice
    assert turn.new_ids == enc(tok, TAIL_AFTER_ANSWER.format("add 3"))[1:]
    assert turn.ids == context + turn.new_ids
    assert turn.ids[len(context) - 1] == tok.eos_token_id != turn.ids[len(context)]
    # the same text the template renders, but not its tokenisation: nothing was re-tokenised
    full = rule.renderer.text(turn.log, add_generation_prompt=True)
    assert tok.decode(turn.ids) == full and turn.ids != enc(tok, full)


def test_a_turn_that_stopped_without_eos_gets_the_whole_glue(tok: Any) -> None:
    rule = PrefixRule(ChatRenderer(tok))
    messages = [{"role": "user", "content": "count to three"}]
    first = rule.first_turn(messages)
    completion = sampled(tok, "one two", eos=False)  # cut by max_tokens
    log = [*messages, {"role": "assistant", "content": "one two"}]
    turn = rule.next_turn(first.ids + completion, log, [*log, {"role": "user", "content": "go on"}])
    assert turn.break_reason is None
    assert turn.new_ids == enc(tok, TAIL_AFTER_ANSWER.format("go on"))
    assert turn.new_ids[0] == tok.eos_token_id
    assert turn.ids == first.ids + completion + turn.new_ids

    # a glue that starts with an ordinary token: a completion that ends on that token still gets all of it
    newline_glue = CHAT_TEMPLATE.replace(
        "message['content'] + '<|im_end|>'", "message['content'] + '\\n<|im_end|>'"
    )
    rule = PrefixRule(ChatRenderer(tok, chat_template=newline_glue))
    assert rule.renderer.glue == "\n<|im_end|>\n"
    first = rule.first_turn(messages)
    completion = sampled(tok, "one two\n", eos=False)
    log = [*messages, {"role": "assistant", "content": "one two\n"}]
    turn = rule.next_turn(first.ids + completion, log, [*log, {"role": "user", "content": "go on"}])
    assert turn.new_ids == enc(
        tok, "\n<|im_end|>\n<|im_start|>user\ngo on\n<|im_end|>\n<|im_start|>assistant\n"
    )
    assert turn.new_ids[0] == completion[-1]  # the completion's "\n" and the glue's, both read


def _tool_episode(tok: Any, rule: PrefixRule) -> dict[str, Any]:
    """A Qwen3-style episode: a tool call, its result (no break), then a new user message (a break)."""
    question = [{"role": "user", "content": "what is 2+2"}]
    first = rule.first_turn(question, [CALCULATOR])
    thought = "<think>\nuse the tool\n</think>\n\n"
    c1 = sampled(
        tok, thought + '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'
    )
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression": "2+2"}'},
    }
    log1 = [*question, {"role": "assistant", "content": thought, "tool_calls": [call]}]
    echoed = {  # what an OpenAI client sends back: arguments re-serialised, SDK fields, another id
        "role": "assistant",
        "content": thought,
        "refusal": None,
        "annotations": [],
        "tool_calls": [
            {**call, "id": "call_x", "function": {"name": "calculator", "arguments": '{"expression":"2+2"}'}}
        ],
    }
    tool_result = {"role": "tool", "tool_call_id": "call_x", "content": "4"}
    turn2 = rule.next_turn(first.ids + c1, log1, [*question, echoed, tool_result], [CALCULATOR], [CALCULATOR])
    c2 = sampled(tok, "<think>\ngot 4\n</think>\n\nthe answer is 4")
    log2 = [*turn2.log, {"role": "assistant", "content": "<think>\ngot 4\n</think>\n\nthe answer is 4"}]
    request3 = [*log2, {"role": "user", "content": "and 3+3"}]
    turn3 = rule.next_turn(turn2.ids + c2, log2, request3, [CALCULATOR], [CALCULATOR])
    return {"first": first, "c1": c1, "turn2": turn2, "c2": c2, "turn3": turn3, "request3": request3}


def test_a_tool_result_splices_and_a_new_user_message_that_rerenders_thinking_breaks(tok: Any) -> None:
    rule = PrefixRule(ChatRenderer(tok, chat_template=QWEN3_STYLE))
    ep = _tool_episode(tok, rule)
    first, c1, turn2, c2, turn3 = ep["first"], ep["c1"], ep["turn2"], ep["c2"], ep["turn3"]
    assert "calculator" in tok.decode(first.ids)  # the tools reach the template

    assert turn2.break_reason is None
    assert turn2.ids == first.ids + c1 + turn2.new_ids
    tool_turn = "<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert turn2.new_ids == enc(tok, "\n" + tool_turn)  # glue minus the sampled EOS, then the tool turn
    assert turn2.log[-1] == {"role": "tool", "tool_call_id": "call_x", "content": "4"}

    assert turn3.break_reason == "template_rerender"
    context = turn2.ids + c2
    assert turn3.ids[: len(context)] != context
    assert (
        turn3.ids
        == turn3.new_ids
        == enc(tok, rule.renderer.text(ep["request3"], [CALCULATOR], add_generation_prompt=True))
    )
    assert "<think>" not in tok.decode(turn3.ids)  # the template dropped the earlier thinking
    unchanged = enc(tok, rule.renderer.text(ep["request3"][:1], [CALCULATOR], add_generation_prompt=False))
    assert turn3.ids[: len(unchanged)] == first.ids[: len(unchanged)]  # the tools and the question


def test_an_episode_trains_only_on_sampled_ids_and_restarts_at_a_break(tok: Any) -> None:
    rule = PrefixRule(ChatRenderer(tok, chat_template=QWEN3_STYLE))
    ep = _tool_episode(tok, rule)
    first, c1, turn2, c2, turn3 = ep["first"], ep["c1"], ep["turn2"], ep["c2"], ep["turn3"]
    lp1, lp2 = [-0.5] * len(c1), [-0.25] * len(c2)
    record = EpisodeTokens.first(first, version=0)
    record.response.extend(TokenDelta("e#0", c1, lp1, "", "stop", detokenized=False), 0)
    assert record.context == first.ids + c1
    record.begin_turn(turn2, version=1)
    assert record.context == turn2.ids
    record.response.extend(TokenDelta("e#1", c2, lp2, "", "stop", detokenized=False), 1)

    new = turn2.new_ids
    assert record.start == first.ids
    assert record.response.tokens == c1 + new + c2
    assert record.response.mask == [True] * len(c1) + [False] * len(new) + [True] * len(c2)
    assert record.response.logprobs == lp1 + [0.0] * len(new) + lp2
    assert record.response.segments == [(0, 0), (len(c1) + len(new), 1)]
    assert record.response.turns == 2 and record.response.finish_reason is None

    with pytest.raises(ValueError, match="not the episode's context"):
        record.begin_turn(TurnPrompt([*turn2.ids, 1], [1], turn2.log), version=1)

    record.begin_turn(turn3, version=1)  # the break: the earlier turns become untrained context
    assert record.untrained == len(c1) + len(c2)
    assert record.start == turn3.ids and record.context == turn3.ids
    assert record.response.tokens == [] and record.response.segments == [(0, 1)]


def test_echoed_messages_compare_canonically_and_a_mismatch_names_its_index() -> None:
    args = '{"expression": "2+2", "exact": true}'
    call = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": args}}
    log = [
        {"role": "user", "content": "what is 2+2"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4"},
        {"role": "assistant", "content": "it is 4"},
    ]
    echo_call = {
        "id": "other",
        "type": "function",
        "function": {"name": "calculator", "arguments": '{"exact":true,"expression":"2+2"}'},
    }
    echoed = [
        log[0],
        {"role": "assistant", "content": None, "tool_calls": [echo_call], "refusal": None, "audio": None},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "4"}]},
        {"role": "assistant", "content": "it is 4", "tool_calls": []},
    ]
    new = {"role": "user", "content": "thanks"}
    assert extension(log, [*echoed, new]) == [new]
    assert extension(log, echoed) == []

    def refused(messages: list[Any]) -> MessagesDoNotExtend:
        with pytest.raises(MessagesDoNotExtend) as info:
            extension(log, messages)
        assert info.value.code == "messages_do_not_extend"
        assert info.value.param == f"messages[{info.value.index}]"
        return info.value

    wrong_args = {
        **echo_call,
        "function": {"name": "calculator", "arguments": '{"expression": "2+3", "exact": true}'},
    }
    err = refused([log[0], {**echoed[1], "tool_calls": [wrong_args]}, *echoed[2:], new])
    assert err.index == 1 and "tool_calls" in str(err)
    err = refused([*echoed[:3], {"role": "assistant", "content": "it is 5"}, new])
    assert err.index == 3 and "content" in str(err) and "'it is 5'" in str(err)
    err = refused([{"role": "system", "content": "what is 2+2"}, *echoed[1:]])
    assert err.index == 0 and "role" in str(err)
    err = refused(echoed[:3])
    assert err.index == 3 and "missing" in str(err)

    with pytest.raises(MessageError) as bad:
        extension(log, [*echoed, "thanks"])
    assert bad.value.index == 4 and not isinstance(bad.value, MessagesDoNotExtend)


def test_template_mode_breaks_when_the_rendered_prompt_does_not_start_with_the_context(tok: Any) -> None:
    rule = PrefixRule(ChatRenderer(tok), mode="template")
    messages = [{"role": "user", "content": "what is 2 plus 2"}]
    first = rule.first_turn(messages)
    log = [*messages, {"role": "assistant", "content": "the sum is 4"}]
    request = [*log, {"role": "user", "content": "add 3"}]
    rendered = enc(tok, rule.renderer.text(request, add_generation_prompt=True))

    canonical = [*enc(tok, "the sum is 4"), tok.eos_token_id]  # sampled as the tokenizer encodes it
    same = rule.next_turn(first.ids + canonical, log, request)
    assert same.break_reason is None and same.ids == rendered
    assert same.new_ids == rendered[len(first.ids) + len(canonical) :]

    mismatch = rule.next_turn(first.ids + sampled(tok, "the sum is 4"), log, request)
    assert mismatch.break_reason == "token_mismatch"
    assert mismatch.ids == mismatch.new_ids == rendered

    # a tool call echoed with its arguments as a JSON string renders them as the object the model wrote
    rule = PrefixRule(ChatRenderer(tok, chat_template=QWEN3_STYLE), mode="template")
    first = rule.first_turn(messages, [CALCULATOR])
    call_text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'
    call = {
        "id": "c",
        "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression":"2+2"}'},
    }
    log = [*messages, {"role": "assistant", "content": "", "tool_calls": [call]}]
    request = [*log, {"role": "tool", "tool_call_id": "c", "content": "4"}]
    context = [*first.ids, *enc(tok, call_text), tok.eos_token_id]
    turn = rule.next_turn(context, log, request, [CALCULATOR], [CALCULATOR])
    assert turn.break_reason is None and turn.ids[: len(context)] == context


def test_changed_tools_break_and_a_template_that_hides_answers_cannot_splice(tok: Any) -> None:
    rule = PrefixRule(ChatRenderer(tok, chat_template=QWEN3_STYLE))
    question = [{"role": "user", "content": "hi"}]
    first = rule.first_turn(question, [CALCULATOR])
    log = [*question, {"role": "assistant", "content": "hello"}]
    request = [*log, {"role": "user", "content": "more"}]
    other = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
    turn = rule.next_turn(first.ids + sampled(tok, "hello"), log, request, [CALCULATOR, other], [CALCULATOR])
    assert turn.break_reason == "tools_changed"
    assert turn.ids == enc(tok, rule.renderer.text(request, [CALCULATOR, other], add_generation_prompt=True))

    hidden = (
        "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}"
        "{{- '(answer)' if m.role == 'assistant' else m.content }}{{- '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    with pytest.raises(ValueError, match="'template' prefix mode"):
        PrefixRule(ChatRenderer(tok, chat_template=hidden))
    assert PrefixRule(ChatRenderer(tok, chat_template=hidden), mode="template").first_turn(question).ids
    with pytest.raises(ValueError, match="expected one of splice, template"):
        PrefixRule(ChatRenderer(tok), mode="exact")
    with pytest.raises(MessageError, match=r"messages\[0\]: missing"):
        PrefixRule(ChatRenderer(tok)).first_turn([])


def test_a_group_prompt_is_the_common_prefix_and_each_rest_is_prepended_masked(tok: Any) -> None:
    rule = PrefixRule(ChatRenderer(tok))
    plain = rule.first_turn([{"role": "user", "content": "what is 2 plus 2"}])
    briefed = rule.first_turn(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2 plus 2"}]
    )
    episodes = [EpisodeTokens.first(plain, 0), EpisodeTokens.first(briefed, 0)]
    c = sampled(tok, "four")
    episodes[0].response.extend(TokenDelta("a#0", c[:2], [-1.0, -2.0], "", None, False), 0)
    episodes[0].response.extend(TokenDelta("a#0", c[2:], [-3.0] * (len(c) - 2), "", "stop", False), 1)
    episodes[1].response.extend(TokenDelta("b#0", c, [-1.0] * len(c), "", "stop", False), 0)
    contexts = [e.context for e in episodes]

    prompt = group_prompt(episodes)
    k = len(prompt)
    assert k > 0 and prompt == plain.ids[:k] == briefed.ids[:k] and plain.ids[k] != briefed.ids[k]
    for episode, context, first in zip(episodes, contexts, (plain, briefed), strict=True):
        rest = len(first.ids) - len(prompt)
        assert prompt + episode.response.tokens == context
        assert episode.response.mask == [False] * rest + [True] * len(c)
        assert episode.response.logprobs[:rest] == [0.0] * rest
    assert episodes[0].response.segments == [(0, 0), (len(plain.ids) - k + 2, 1)]
    assert episodes[1].response.segments == [(0, 0)]
    assert group_prompt(episodes) == prompt  # a second call finds nothing left to move

    stray = EpisodeTokens([7, 8], Response(0))
    with pytest.raises(ValueError, match="agent_no_common_prompt"):
        group_prompt([EpisodeTokens([1, 2], Response(0)), stray])
