"""The agent API (services/sampler/agents/): the real FastAPI app on uvicorn, called with the official ``openai``
client and httpx, over an :class:`EpisodeBook` pumped by a stand-in for the sampler's loop.

The engine is scripted (the logic under test is the API's and the book's, not generation): each turn plays the
next scripted text one character per token, which is not how the tokenizer encodes it, so a prompt built by
re-tokenising returned text would differ from the ids checked here. The real engine, Redis and the rollouts
stream are tests/test_agent_stack.py's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from services.common.tiny_model import TinyModelSpec, build_tokenizer, qwen2_config
from services.sampler.agents.api import AgentApi
from services.sampler.agents.episodes import EpisodeBook
from services.sampler.agents.tokens import ChatRenderer, PrefixRule
from services.sampler.engine import Sampling, TokenDelta
from services.sampler.groups import Group
from tests.test_agent_tokens import CALCULATOR, QWEN3_STYLE
from vcpo.v1 import rollout_pb2

TOKEN = "agent-test-token"
TOOL_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'


class ScriptedEngine:
    """Answers each turn with the next scripted text, one character per token, then EOS; log-prob -0.5 each."""

    max_model_len = 512

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.loaded_version: int | None = 0
        self.script: deque[str] = deque()
        self.active: dict[str, list[int]] = {}
        self.prompts: dict[str, list[int]] = {}
        self.sampling: dict[str, Sampling] = {}
        self.aborted: list[str] = []
        self.ending: dict[str, str] = {}
        self.taken: dict[str, list[int]] = {}  # with stop strings: the ids so far and their text
        self.said: dict[str, str] = {}
        self.lock = threading.Lock()

    def ids(self, text: str) -> list[int]:
        return [t for ch in text for t in self.tok.encode(ch, add_special_tokens=False)] + [
            self.tok.eos_token_id
        ]

    def add(self, request_id: str, prompt_tokens: list[int], sampling: Sampling) -> None:
        with self.lock:
            self.prompts[request_id], self.sampling[request_id] = list(prompt_tokens), sampling
            ids = self.ids(self.script.popleft())
            self.active[request_id] = ids[: sampling.max_tokens]
            self.ending[request_id] = "length" if len(ids) > sampling.max_tokens else "stop"

    def step(self) -> list[TokenDelta]:
        out = []
        with self.lock:
            for request_id, left in list(self.active.items()):
                token = left.pop(0)
                ending = None if left else self.ending[request_id]
                stop = self.sampling[request_id].stop
                if stop:  # as vLLM: it detokenizes, ends at a stop string and leaves it out of the text
                    taken = self.taken.setdefault(request_id, [])
                    taken.append(token)
                    seen, said = self.decode(taken), self.said.get(request_id, "")
                    hit = next((s for s in stop if s in seen), None)
                    if hit is not None:
                        left.clear()
                        ending, seen = "stop", seen[: seen.index(hit)]
                    self.said[request_id] = seen
                    out.append(TokenDelta(request_id, [token], [-0.5], seen[len(said) :], ending, True))
                else:
                    out.append(TokenDelta(request_id, [token], [-0.5], "", ending, False))
                if not left:
                    del self.active[request_id]
        return out

    def abort(self, request_ids: list[str]) -> None:
        with self.lock:
            for request_id in request_ids:
                if self.active.pop(request_id, None) is not None:
                    self.aborted.append(request_id)

    def decode(self, tokens: list[int]) -> str:
        return str(self.tok.decode(tokens, skip_special_tokens=True))


class LoopStandIn:
    """The sampler's loop as far as the book sees it: admits groups of its tasks, pumps the book, steps the engine;
    ``newest`` is the newest published version (the lag bound's)."""

    def __init__(
        self,
        tok: Any,
        engine: ScriptedEngine,
        n: int = 2,
        k: int = 1,
        replica: str = "sampler-0",
        **book: Any,
    ) -> None:
        self.engine, self.n, self.k, self.newest, self.replica = engine, n, k, 0, replica
        self.tasks: deque[rollout_pb2.Task] = deque(
            rollout_pb2.Task(task_id=f"t{i}", prompt=f"what is {i} plus 2") for i in range(8)
        )
        self.finished: list[Group] = []
        self.given_up: list[tuple[Group, str, str]] = []
        self.count = 0
        self.book = EpisodeBook(
            engine,  # type: ignore[arg-type]
            PrefixRule(ChatRenderer(tok, chat_template=QWEN3_STYLE)),
            Sampling(max_tokens=256),
            admit=self.admit,
            messages=lambda group: [{"role": "user", "content": group.task.prompt}],
            lag=lambda group: self.newest - group.version,
            k=k,
            id_prefix=f"{replica}.abcd-",
            **{"episode_timeout_s": 60.0, "max_turns": 4, **book},
        )
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def admit(self) -> tuple[Group | None, str]:
        if not self.tasks:
            return None, "no task is waiting"
        self.count += 1
        task = self.tasks.popleft()
        group_id = f"{self.replica}.abcd-{self.count}"
        return Group(group_id, task, [1], self.newest, Sampling(), self.n, multi_turn=True), ""

    def run(self) -> None:
        while not self.stop.is_set():
            finished, given_up = self.book.pump()
            self.finished += finished
            self.given_up += given_up
            for delta in self.engine.step():
                if self.book.owns(delta.request_id):
                    self.book.absorb(delta, self.engine.loaded_version or 0)
            time.sleep(0.002)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny model's tokenizer (its files only: the weights play no part)."""
    from transformers import AutoTokenizer

    model_dir = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tokenizer().save_pretrained(model_dir)
    qwen2_config(TinyModelSpec()).save_pretrained(model_dir)
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture
def api(tok: Any, request: pytest.FixtureRequest) -> Iterator[tuple[AgentApi, LoopStandIn]]:
    settings = getattr(request, "param", {})
    loop = LoopStandIn(tok, ScriptedEngine(tok), **settings)
    server = AgentApi(
        loop.book, model="tiny", token=TOKEN, tokenizer=tok, tool_parser="hermes", claim_timeout_s=0.5, port=0
    )
    yield server, loop
    loop.stop.set()
    loop.thread.join(5)
    loop.book.close()
    server.close()


def http(server: AgentApi, token: str = TOKEN) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=30)


def claim(server: AgentApi) -> dict[str, Any]:
    with http(server) as c:
        reply = c.post("/v1/episodes")
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def wait_for(check: Any, timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.01)
    raise AssertionError("timed out")


def test_an_openai_client_agent_calls_a_tool_and_its_episode_is_the_sampled_ids(
    api: tuple[AgentApi, LoopStandIn], tok: Any
) -> None:
    server, loop = api
    engine = loop.engine
    with http(server) as c:
        assert c.get("/v1/models").json()["data"][0]["id"] == "tiny"
    first, second = claim(server), claim(server)
    assert first["task_id"] == second["task_id"] == "t0" and first["id"] != second["id"]
    assert first["messages"] == [{"role": "user", "content": "what is 0 plus 2"}] and first["max_turns"] == 4
    assert first["base_url"] == f"{server.url}/v1/episodes/{first['id']}/v1"

    agent = openai.OpenAI(base_url=first["base_url"], api_key=TOKEN)
    engine.script.extend(["let me compute " + TOOL_CALL, "It is 5."])
    messages: list[dict[str, Any]] = list(first["messages"])
    reply = agent.chat.completions.create(model="tiny", messages=messages, tools=[CALCULATOR])  # type: ignore[list-item]
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "let me compute "
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "2+3"}
    turn1 = f"{first['id']}#0"
    assert reply.usage is not None and reply.usage.prompt_tokens == len(engine.prompts[turn1])
    assert reply.usage.completion_tokens == len(engine.ids("let me compute " + TOOL_CALL))

    messages += [
        choice.message.model_dump(exclude_none=True),  # echoed as the SDK returned it
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    pieces = [
        chunk.choices[0].delta.content or ""
        for chunk in agent.chat.completions.create(
            model="tiny",
            messages=messages,
            tools=[CALCULATOR],
            stream=True,  # type: ignore[arg-type]
        )
        if chunk.choices
    ]
    assert "".join(pieces) == "It is 5."
    # the second prompt is the first prompt and the sampled ids, then only what the template appended
    context = engine.prompts[turn1] + engine.ids("let me compute " + TOOL_CALL)
    turn2 = engine.prompts[f"{first['id']}#1"]
    assert turn2[: len(context)] == context and tok.eos_token_id in turn2[len(context) - 1 : len(context)]

    other = openai.OpenAI(base_url=second["base_url"], api_key=TOKEN)
    engine.script.append("two plus zero is two")
    stream = other.chat.completions.create(
        model="tiny",
        messages=second["messages"],
        stream=True,
        stream_options={"include_usage": True},
        temperature=0.5,
        max_tokens=10,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "two plus z"  # cut at max_tokens = 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    assert engine.sampling[f"{second['id']}#0"].temperature == 0.5  # the request's, not the run's

    with http(server) as c:
        assert (
            c.post(f"/v1/episodes/{first['id']}/finish", json={"reward": 1.0}).json()["group_complete"]
            is False
        )
        # a finished episode gives its seat back at once (the sampler's request cap counts the rest)
        assert loop.book.groups[first["group_id"]].group.unfinished == 1
        assert c.post(f"/v1/episodes/{second['id']}/finish", json={}).json()["group_complete"] is True
        again = c.post(f"/v1/episodes/{first['id']}/finish", json={})
    assert again.status_code == 404 and again.json()["error"]["code"] == "episode_not_found"
    (group,) = wait_for(lambda: loop.finished)
    a, b = (group.responses[e["id"]] for e in (first, second))
    assert group.prompt_tokens == engine.prompts[turn1][: len(group.prompt_tokens)]
    assert list(group.prompt_tokens) + a.tokens == turn2 + engine.ids("It is 5.")
    sampled = engine.ids("let me compute " + TOOL_CALL) + engine.ids("It is 5.")
    assert [t for t, m in zip(a.tokens, a.mask, strict=True) if m] == sampled
    assert [p for p, m in zip(a.logprobs, a.mask, strict=True) if m] == [-0.5] * len(sampled)
    assert all(p == 0.0 for p, m in zip(a.logprobs, a.mask, strict=True) if not m)
    assert a.turns == 2 and a.agent_reward == 1.0 and a.final_text == "It is 5."
    assert b.agent_reward is None and b.final_text == "two plus z" and sum(b.mask) == 10
    proto = group.to_proto("run", "sampler-0", engine.decode)
    assert proto.trajectories[0].reward.scorer == "agent" and not proto.trajectories[1].HasField("reward")
    assert proto.trajectories[0].text == "It is 5."


def test_bad_requests_get_openai_errors_that_name_what_was_wrong(api: tuple[AgentApi, LoopStandIn]) -> None:
    server, loop = api
    for token in ("", "wrong"):
        with http(server, token) as c:
            refused = c.post("/v1/episodes")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    episode = claim(server)
    agent = openai.OpenAI(base_url=episode["base_url"], api_key=TOKEN)
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"n": 2}, 400, "unsupported_parameter"),
        ({"max_tokens": 10_000}, 400, "context_length_exceeded"),
        ({"messages": [{"role": "user", "content": "x " * 600}]}, 400, "context_length_exceeded"),
        ({"messages": [{"content": "no role"}]}, 400, "invalid_request"),
        ({"tool_choice": "required", "tools": [CALCULATOR]}, 400, "unsupported_parameter"),
    ]
    for extra, status, code in cases:
        with pytest.raises(openai.APIStatusError) as caught:
            agent.chat.completions.create(**{"model": "tiny", "messages": episode["messages"], **extra})
        assert caught.value.status_code == status and caught.value.code == code, (extra, caught.value.body)
    with http(server) as c:
        empty = c.post(f"/v1/episodes/{episode['id']}/finish", json={})
        assert empty.status_code == 409 and empty.json()["error"]["code"] == "episode_empty"
        assert c.post(f"/v1/episodes/{episode['id']}/finish", json={"reward": "high"}).status_code == 400
        assert c.post(f"/v1/episodes/{episode['id']}/finish", content=b"{not json").status_code == 400
        lost = c.post("/v1/episodes/sampler-0.0000-3.0/finish", json={})
        assert lost.status_code == 404 and lost.json()["error"]["code"] == "episode_lost"
        assert "restarted" in lost.json()["error"]["message"]

    loop.engine.script.append("four")
    agent.chat.completions.create(model="tiny", messages=episode["messages"])
    with pytest.raises(openai.BadRequestError) as caught:  # the answer left out: not an extension
        agent.chat.completions.create(
            model="tiny", messages=[*episode["messages"], {"role": "user", "content": "and?"}]
        )
    assert caught.value.code == "messages_do_not_extend" and "messages[1]" in str(caught.value.body)


@pytest.mark.parametrize("api", [{"k": 1}], indirect=True)
def test_a_turn_past_the_lag_bound_gets_409_and_its_group_is_given_up(
    api: tuple[AgentApi, LoopStandIn],
) -> None:
    server, loop = api
    first, second = claim(server), claim(server)
    loop.newest = 2  # the group started at version 0; k = 1
    agent = openai.OpenAI(base_url=first["base_url"], api_key=TOKEN)
    with pytest.raises(openai.ConflictError) as caught:
        agent.chat.completions.create(model="tiny", messages=first["messages"])
    assert caught.value.code == "episode_stale" and "k = 1" in str(caught.value.body)
    ((group, reason, _),) = wait_for(lambda: loop.given_up)
    assert reason == "lag" and group.task.task_id == "t0"
    with http(server) as c:  # the other episode of the group hears why too
        finished = c.post(f"/v1/episodes/{second['id']}/finish", json={"reward": 0.0})
    assert finished.status_code == 409 and finished.json()["error"]["code"] == "episode_stale"
    assert claim(server)["task_id"] == "t1"  # a fresh group at the newest version


@pytest.mark.parametrize("api", [{"episode_timeout_s": 0.3}], indirect=True)
def test_expired_abandoned_and_unclaimable_episodes_give_their_groups_up(
    api: tuple[AgentApi, LoopStandIn],
) -> None:
    server, loop = api
    expired = claim(server)
    ((_, reason, message),) = wait_for(lambda: loop.given_up)
    assert reason == "agent_expired" and "agents.episode_timeout_s" in message
    with http(server) as c:
        late = c.post(f"/v1/episodes/{expired['id']}/abandon")
        assert late.status_code == 409 and late.json()["error"]["code"] == "episode_expired"
        loop.book.episode_timeout_s = 60.0
        abandoned = claim(server)
        assert c.post(f"/v1/episodes/{abandoned['id']}/abandon").json() == {
            "id": abandoned["id"],
            "abandoned": True,
        }
        wait_for(lambda: len(loop.given_up) == 2)
        assert loop.given_up[1][1] == "agent_abandoned"
        loop.tasks.clear()
        loop.book.groups.clear()
        none = c.post("/v1/episodes")
    assert none.status_code == 503 and none.json()["error"]["code"] == "no_episode"
    assert "no task is waiting" in none.json()["error"]["message"]


def test_a_client_that_goes_away_mid_turn_leaves_no_trace(api: tuple[AgentApi, LoopStandIn]) -> None:
    server, loop = api
    episode = claim(server)
    engine = loop.engine
    engine.script.append("x" * 200)
    original_step = engine.step

    def slow_step() -> list[TokenDelta]:
        time.sleep(0.01)
        return original_step()

    engine.step = slow_step  # type: ignore[method-assign]
    url = f"{episode['base_url']}/chat/completions"
    body = {"model": "tiny", "messages": episode["messages"], "stream": True}
    with http(server) as c, c.stream("POST", url, json=body) as reply:
        assert reply.status_code == 200
        next(reply.iter_lines())  # the first chunk: the turn is running; then the client goes away
    wait_for(lambda: loop.book.counts["cancelled"] == 1)
    assert engine.aborted == [f"{episode['id']}#0"]
    first_prompt = engine.prompts.pop(f"{episode['id']}#0")
    engine.step = original_step  # type: ignore[method-assign]
    engine.script.append("four")
    agent = openai.OpenAI(base_url=episode["base_url"], api_key=TOKEN)
    reply = agent.chat.completions.create(model="tiny", messages=episode["messages"])  # turn 1 again
    assert reply.choices[0].message.content == "four"
    assert engine.prompts[f"{episode['id']}#0"] == first_prompt  # nothing of the cancelled turn in it
    tokens = loop.book.episodes[episode["id"]].tokens
    assert tokens is not None and tokens.response.tokens == engine.ids("four")
    assert loop.book.episodes[episode["id"]].turns == 1


def test_the_openai_agent_example_plays_episodes_with_its_calculator(
    api: tuple[AgentApi, LoopStandIn], tok: Any, tmp_path: Path
) -> None:
    server, loop = api
    loop.engine.script.extend([TOOL_CALL, "It is 5.", TOOL_CALL, "It is 5."])
    (tmp_path / "token").write_text(TOKEN + "\n")
    played = subprocess.run(
        [
            sys.executable,
            "examples/openai_agent.py",
            "--base-url",
            server.url,
            "--token-file",
            str(tmp_path / "token"),
            "--episodes",
            "2",
            "--concurrency",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parent.parent,
    )
    assert played.returncode == 0, played.stderr
    lines = played.stdout.splitlines()
    assert len(lines) == 2 and all(
        "task t0, 1 calculator call(s), answer 'It is 5.'" in line for line in lines
    )
    (group,) = wait_for(lambda: loop.finished)
    for response in group.responses.values():
        read = tok.decode([t for t, m in zip(response.tokens, response.mask, strict=True) if not m])
        trained = tok.decode([t for t, m in zip(response.tokens, response.mask, strict=True) if m])
        assert "<tool_response>\n5\n</tool_response>" in read  # the calculator's answer: read, not trained
        assert trained == f"{TOOL_CALL}<|im_end|>It is 5.<|im_end|>"  # each turn's ids, its EOS included
        assert response.turns == 2 and response.final_text == "It is 5."


def test_the_launcher_writes_agents_json_with_every_replicas_url_and_the_token_file(tmp_path: Path) -> None:
    from deploy.config import SystemConfig
    from deploy.launcher_services import Services

    def launcher(cfg: SystemConfig, run_dir: Path) -> Services:
        """The launcher's services as far as agents.json needs them (no Ray, nothing started)."""
        services = Services.__new__(Services)
        services.cfg, services.run_dir = cfg, run_dir
        return services

    cfg = SystemConfig.model_validate({"sampler": {"replicas": 2}, "agents": {"enabled": True}})
    (tmp_path / "sampler").mkdir()
    for i in range(2):
        body = {"grpc_port": 1, "metrics_url": "", "pid": 1, "agents_url": f"http://127.0.0.1:{8000 + i}"}
        (tmp_path / "sampler" / f"sampler-{i}.endpoints.json").write_text(json.dumps(body))
    line = launcher(cfg, tmp_path).agents_file()
    written = json.loads((tmp_path / "agents.json").read_text())
    assert written == {
        "base_url": "http://127.0.0.1:8000",
        "base_urls": ["http://127.0.0.1:8000", "http://127.0.0.1:8001"],
        "token_file": str((tmp_path / "api_token").resolve()),
    }
    assert "http://127.0.0.1:8000, http://127.0.0.1:8001" in line and str(tmp_path / "agents.json") in line
    cfg = SystemConfig.model_validate({"sampler": {"api_token": "s3cret"}, "agents": {"enabled": True}})
    launcher(cfg, tmp_path).agents_file()
    written = json.loads((tmp_path / "agents.json").read_text())
    assert written["token_setting"] == "sampler.api_token" and "s3cret" not in json.dumps(written)


def test_completions_extend_the_episodes_ids_with_only_the_new_texts_ids(
    api: tuple[AgentApi, LoopStandIn], tok: Any
) -> None:
    server, loop = api
    engine = loop.engine
    breaks: list[str] = []
    loop.book.on_break = breaks.append
    episode = claim(server)
    agent = openai.OpenAI(base_url=episode["base_url"], api_key=TOKEN)
    engine.script.extend(["twelve", "and more", "again"])
    prompt = "Q: what is 7 plus 5?\nA:"
    first = agent.completions.create(model="tiny", prompt=prompt)
    assert first.choices[0].text == "twelve" and first.choices[0].finish_reason == "stop"
    turn1 = f"{episode['id']}#0"
    assert engine.prompts[turn1] == tok.encode(prompt)
    follow = prompt + "twelve" + "\nQ: and then?\nA:"
    pieces = [c.choices[0].text for c in agent.completions.create(model="tiny", prompt=follow, stream=True)]
    assert "".join(pieces) == "and more"
    # the sampled ids (one per character, then EOS), then only the new text's ids: nothing re-tokenised
    assert engine.prompts[f"{episode['id']}#1"] == (
        engine.prompts[turn1]
        + engine.ids("twelve")
        + tok.encode("\nQ: and then?\nA:", add_special_tokens=False)
    )
    assert breaks == []
    with pytest.raises(openai.BadRequestError) as caught:  # one kind of turn per episode
        agent.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.code == "mixed_turns"
    with pytest.raises(openai.BadRequestError) as caught:
        agent.completions.create(model="tiny", prompt="x", echo=True)
    assert caught.value.code == "unsupported_parameter"
    agent.completions.create(model="tiny", prompt="a different start")  # does not extend: a new segment
    assert breaks == ["token_mismatch"]
    assert engine.prompts[f"{episode['id']}#2"] == tok.encode("a different start")
    record = loop.book.episodes[episode["id"]].tokens
    assert record is not None and record.untrained == len(engine.ids("twelve") + engine.ids("and more"))
    other = claim(server)
    engine.script.append("nine")
    openai.OpenAI(base_url=other["base_url"], api_key=TOKEN).completions.create(
        model="tiny", prompt="a different question"
    )
    with http(server) as c:
        assert c.post(f"/v1/episodes/{episode['id']}/finish", json={}).status_code == 200
        assert c.post(f"/v1/episodes/{other['id']}/finish", json={}).json()["group_complete"]
    (group,) = wait_for(lambda: loop.finished)
    response = group.responses[episode["id"]]
    assert response.final_text == "again" and response.turns == 3
    # trained: the ids sampled after the break only, in the context they were sampled in
    assert [t for t, m in zip(response.tokens, response.mask, strict=True) if m] == engine.ids("again")
    assert list(group.prompt_tokens) + response.tokens == tok.encode("a different start") + engine.ids(
        "again"
    )


def test_a_group_whose_episodes_share_no_prompt_token_is_given_up_not_written(
    api: tuple[AgentApi, LoopStandIn],
) -> None:
    server, loop = api
    first, second = claim(server), claim(server)
    loop.engine.script.extend(["one", "two"])
    for episode, prompt in ((first, "apples"), (second, "7 pears")):
        openai.OpenAI(base_url=episode["base_url"], api_key=TOKEN).completions.create(
            model="tiny", prompt=prompt
        )
    with http(server) as c:
        assert c.post(f"/v1/episodes/{first['id']}/finish", json={}).status_code == 200
        refused = c.post(f"/v1/episodes/{second['id']}/finish", json={})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "no_common_prompt"
    ((_, reason, _),) = wait_for(lambda: loop.given_up)
    assert reason == "agent_invalid" and not loop.finished


def test_any_replica_passes_an_episodes_requests_on_to_the_replica_that_holds_it(tok: Any) -> None:
    """Behind one Kubernetes Service a turn may reach any replica: it goes on to the episode's own."""
    loops = {name: LoopStandIn(tok, ScriptedEngine(tok), replica=name) for name in ("sampler-0", "sampler-1")}
    urls: dict[str, str] = {}
    servers = {
        name: AgentApi(
            loop.book,
            model="tiny",
            token=TOKEN,
            tokenizer=tok,
            tool_parser="hermes",
            claim_timeout_s=0.5,
            replica=name,
            peer=urls.get,
        )
        for name, loop in loops.items()
    }
    urls.update({name: server.url for name, server in servers.items()})
    try:
        held = claim(servers["sampler-1"])
        assert held["id"].startswith("sampler-1.")
        front = f"{servers['sampler-0'].url}/v1/episodes/{held['id']}/v1"  # the Service sent it to sampler-0
        agent = openai.OpenAI(base_url=front, api_key=TOKEN)
        loops["sampler-1"].engine.script.extend(["five", "six"])
        reply = agent.chat.completions.with_raw_response.create(model="tiny", messages=held["messages"])
        assert reply.parse().choices[0].message.content == "five"
        assert float(reply.headers["x-vcpo-engine-ms"]) >= 0
        messages = [
            *held["messages"],
            {"role": "assistant", "content": "five"},
            {"role": "user", "content": "+1"},
        ]
        stream = agent.chat.completions.create(model="tiny", messages=messages, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "six"
        assert not loops["sampler-0"].engine.prompts  # sampler-0 generated nothing
        with http(servers["sampler-0"]) as c:
            assert c.post(f"/v1/episodes/{held['id']}/finish", json={}).json()["finished"] is True
            unknown = c.post("/v1/episodes/sampler-7.abcd-1.0/finish", json={})
            assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "episode_lost"
            refused = httpx.post(f"{front}/chat/completions", json={"messages": []})  # no token: refused
            assert refused.status_code == 401
            servers["sampler-1"].close()
            gone = c.post(f"/v1/episodes/{held['id']}/abandon")
        assert gone.status_code == 503 and gone.json()["error"]["code"] == "replica_unreachable"
    finally:
        for name, loop in loops.items():
            loop.stop.set()
            loop.thread.join(5)
            loop.book.close()
            servers[name].close()


def test_a_stopping_sampler_ends_its_open_turns_and_claims_with_503_not_a_hang(
    api: tuple[AgentApi, LoopStandIn],
) -> None:
    server, loop = api
    episode = claim(server)
    loop.engine.script.append("y" * 200)
    original_step = loop.engine.step

    def slow_step() -> list[TokenDelta]:
        time.sleep(0.01)
        return original_step()

    loop.engine.step = slow_step  # type: ignore[method-assign]
    agent = openai.OpenAI(base_url=episode["base_url"], api_key=TOKEN, max_retries=0)
    answered: list[BaseException] = []

    def turn() -> None:
        try:
            agent.chat.completions.create(model="tiny", messages=episode["messages"])
        except openai.APIStatusError as exc:
            answered.append(exc)

    thread = threading.Thread(target=turn)
    thread.start()
    wait_for(lambda: loop.book.requests)  # the turn is in the engine
    loop.stop.set()  # the sampler's loop stops, then closes the book on its thread
    loop.thread.join(5)
    loop.book.close()
    thread.join(10)
    (error,) = answered
    assert (
        isinstance(error, openai.APIStatusError)
        and error.status_code == 503
        and error.code == "sampler_stopping"
    )
    with http(server) as c:
        late = c.post("/v1/episodes")
    assert late.status_code == 503 and late.json()["error"]["code"] == "sampler_stopping"


def test_a_stop_string_ends_the_answer_and_is_left_out_of_its_text_but_not_out_of_its_ids(
    api: tuple[AgentApi, LoopStandIn],
) -> None:
    server, loop = api
    episode = claim(server)
    loop.engine.script.append("four. The end")
    agent = openai.OpenAI(base_url=episode["base_url"], api_key=TOKEN)
    reply = agent.chat.completions.create(model="tiny", messages=episode["messages"], stop=["."])
    assert reply.choices[0].message.content == "four" and reply.choices[0].finish_reason == "stop"
    tokens = loop.book.episodes[episode["id"]].tokens
    assert tokens is not None and tokens.response.tokens == loop.engine.ids("four.")[:-1]  # sampled up to "."
