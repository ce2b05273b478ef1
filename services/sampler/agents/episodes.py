"""Agent episodes on the sampler's loop: claims, turns, finishes and give-ups, run where the engine is.

    HTTP thread (api.py)              EpisodeBook (the sampler's loop thread, once per tick)
    submit(Claim) ─── inbox ───────►  pump: an unclaimed episode of an open group, else admit() a new group
                                            (a task the lag bound admits; the group's n episodes wait to be
                                            claimed, by any agents); none within claim_timeout_s: 503
    submit(Turn)  ─── inbox ───────►  pump: the prefix rule (tokens.py) makes the prompt ids ─► engine.add
                   ◄── future ──────  absorb: the engine's tokens, log-probs and versions recorded; the
                   ◄── on_text ─────           turn's text streamed; at its end the answer (tool calls parsed)
    submit(Finish|Abandon) ────────►  pump: every episode of a group finished: the group is emitted
                                            (exactly once, as any group); abandoned or expired: given up

Everything that touches the engine or the episodes' tokens runs on the loop's thread, as the in-process agent
loop (``services/sampler/agent.py``) does: the HTTP threads only wait for futures (or :class:`AgentError`).

An episode is a response of its group: its first prompt (or the prompt of its last prefix break) and every
id after it, sampled (trained, with behaviour log-probs and the version of each token) or read (the new
messages of later turns, masked). When the group is done its common prompt becomes ``prompt_tokens``
(:func:`tokens.group_prompt`). A turn whose client went away (:class:`Cancel`) is rolled back, as if it
never ran: the client never saw its answer, so it cannot send it back.

The lag bound: a group's version is the one loaded when it was admitted; a turn that starts once the newest
published version is more than ``k`` ahead gets 409 ``episode_stale`` and gives the group up (its task
retried), as the sampler gives up any group grown that stale.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from services.sampler.agents.commands import (
    Abandon,
    AgentError,
    AgentGroup,
    Cancel,
    Claim,
    Command,
    Episode,
    Finish,
    InFlight,
    Turn,
    TurnResult,
    stale_error,
    stopping_error,
    turn_sampling,
)
from services.sampler.agents.tokens import (
    EpisodeTokens,
    MessageError,
    PrefixRule,
    group_prompt,
)
from services.sampler.engine import GenerationEngine, Sampling, TokenDelta
from services.sampler.groups import Group

log = logging.getLogger(__name__)

AGENT_GROUPS = (
    "{}:produced:agents"  # of the rollouts stream's key: the agents' groups it was written, for the ledger
)
REMEMBERED = 4096  # episodes of given-up groups whose clients are told why, newest first


class EpisodeBook:
    """The open agent groups of one sampler replica (module docstring)."""

    def __init__(
        self,
        engine: GenerationEngine,
        rule: PrefixRule,
        sampling: Sampling,
        *,
        admit: Callable[[], tuple[Group | None, str]],
        messages: Callable[[Group], list[dict[str, str]]],
        lag: Callable[[Group], int],
        k: int,
        episode_timeout_s: float,
        max_turns: int,
        id_prefix: str = "",
        on_break: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``admit``: a newly admitted group of a task for agents, or (None, why not); ``messages``: its task's
        prompt as chat messages; ``lag``: how far the newest published version is ahead of a group's;
        ``id_prefix``: what this run of the replica starts its group ids with (``<replica>.<incarnation>-``)."""
        self.engine, self.rule, self.sampling = engine, rule, sampling
        self.admit, self.messages_of, self.lag, self.k = admit, messages, lag, k
        self.episode_timeout_s, self.max_turns = episode_timeout_s, max_turns
        self.id_prefix = id_prefix
        self.on_break = on_break or (lambda reason: None)
        self.clock = clock
        self.inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wake = threading.Event()  # set by submit: an idle loop takes the command at once
        self.groups: dict[str, AgentGroup] = {}
        self.episodes: dict[str, Episode] = {}
        self.requests: dict[str, Episode] = {}  # engine request id -> the episode of its turn
        self.gone: OrderedDict[str, AgentError] = OrderedDict()  # episodes of given-up groups -> why
        self.claims: deque[Claim] = deque()
        self.waiting_reason = ""  # why the last claim found no task
        self.closed = False
        self.counts: dict[str, int] = {"claimed": 0, "turns": 0, "finished": 0, "cancelled": 0}
        self._finished: list[Group] = []
        self._failed: list[tuple[Group, str, str]] = []

    # ------------------------------------------------------------------ any thread
    def submit(self, command: Command) -> Any:
        """Queue ``command`` for the loop; returns its future."""
        if self.closed:
            command.future.set_exception(stopping_error())
        else:
            self.inbox.put(command)
            self._wake.set()
        return command.future

    def idle(self, timeout_s: float) -> None:
        """The loop has nothing to step: wait up to ``timeout_s``, less if a request comes in."""
        if self._wake.wait(timeout_s):
            self._wake.clear()

    # ------------------------------------------------------------------ the loop's thread
    def pump(self) -> tuple[list[Group], list[tuple[Group, str, str]]]:
        """Run the commands that came in and expire what is due; returns (groups whose episodes all finished,
        (group, reason, failure) of groups to give up)."""
        while True:
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, Claim):
                self.claims.append(command)
                continue
            if not command.future.set_running_or_notify_cancel():  # its client went away meanwhile
                continue
            try:
                if isinstance(command, Turn):
                    self._turn(command)
                elif isinstance(command, Finish):
                    command.future.set_result(self._finish(command))
                elif isinstance(command, Abandon):
                    command.future.set_result(self._abandon(command.episode_id))
                else:
                    command.future.set_result(self._cancel(command))
            except AgentError as exc:
                command.future.set_exception(exc)
        self._serve_claims()
        self._expire()
        finished, failed = self._finished, self._failed
        self._finished, self._failed = [], []
        return finished, failed

    def owns(self, request_id: str) -> bool:
        return request_id in self.requests

    def absorb(self, delta: TokenDelta, version: int) -> None:
        episode = self.requests[delta.request_id]
        flight = episode.turn
        assert episode.tokens is not None and flight is not None
        response = episode.tokens.response
        response.extend(delta, version)
        sampled = response.tokens[flight.start :]
        flight.pieces.append(delta.text)
        flight.raw |= not delta.detokenized
        if flight.turn.on_text is not None and delta.token_ids:
            # the engine's text where it detokenizes (with stop strings: cut before them), else the ids decoded
            text = "".join(flight.pieces) if not flight.raw else self.engine.decode(sampled)
            if len(text) > flight.sent and not text.endswith("\ufffd"):  # not mid-way through a character
                try:
                    flight.turn.on_text(text[flight.sent :])
                except RuntimeError:  # the server's event loop is closed: nobody reads the stream
                    flight.turn.on_text = None
                flight.sent = len(text)
        if delta.finish_reason is None:
            return
        del self.requests[delta.request_id]
        episode.turn = None
        text = "".join(flight.pieces) if not flight.raw else self.engine.decode(sampled)
        turn = flight.turn
        try:
            message = turn.answer(text)
        except Exception as exc:  # a tool parser's own failure: the answer stays text
            log.warning("episode %s: the tool parser failed (%s); answering with text", episode.id, exc)
            message = {"role": "assistant", "content": text}
        episode.log.append(message)
        episode.turns += 1
        self.counts["turns"] += 1
        if message.get("tool_calls"):
            finish = "tool_calls"
        else:
            finish = "length" if delta.finish_reason == "length" else "stop"
        turn.future.set_result(
            TurnResult(
                message,
                text,
                finish,
                flight.prompt_len,
                len(sampled),
                list(sampled),
                flight.request_id,
                time.monotonic() - flight.added_at,
            )
        )

    def abort(self, group: Group, error: AgentError) -> None:
        """The sampler gives ``group`` up (it grew too stale, the weights were lost, the sampler stops): its
        turns end with ``error``, and so does every later request of its episodes."""
        agent_group = self.groups.get(group.group_id)
        if agent_group is None:
            return
        agent_group.failure = error
        for episode in agent_group.episodes:
            self._end_turn(episode, error)
        self._forget(agent_group)

    def _end_turn(self, episode: Episode, error: AgentError) -> InFlight | None:
        """Stop the episode's turn in the engine, if it has one, and answer it with ``error``."""
        flight, episode.turn = episode.turn, None
        if flight is not None:
            self.engine.abort([flight.request_id])
            self.requests.pop(flight.request_id, None)
            if not flight.turn.future.done():
                flight.turn.future.set_exception(error)
        return flight

    def close(self) -> None:
        """The sampler stops: every waiting request is answered (503), later ones at once."""
        self.closed = True
        for agent_group in list(self.groups.values()):
            self.abort(agent_group.group, stopping_error())
        waiting: list[Command] = list(self.claims)
        self.claims.clear()
        while True:
            try:
                waiting.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        for command in waiting:
            if command.future.set_running_or_notify_cancel():
                command.future.set_exception(stopping_error())

    def episodes_open(self) -> int:
        return sum(not e.finished for g in self.groups.values() for e in g.episodes if e.claimed)

    # ------------------------------------------------------------------ claims
    def _serve_claims(self) -> None:
        now = self.clock()
        while self.claims:
            claim = self.claims[0]
            if claim.future.cancelled():  # its client went away
                self.claims.popleft()
                continue
            episode = self._unclaimed()
            if episode is None:
                group, why = self.admit()
                if group is None:
                    self.waiting_reason = why
                    break
                self._open(group, now)
                continue
            self.claims.popleft()
            if not claim.future.set_running_or_notify_cancel():
                continue
            episode.claimed, episode.expires_at = True, now + self.episode_timeout_s
            self.counts["claimed"] += 1
            agent_group = episode.group
            claim.future.set_result(
                {
                    "id": episode.id,
                    "object": "episode",
                    "task_id": agent_group.group.task.task_id,
                    "group_id": agent_group.group.group_id,
                    "messages": copy.deepcopy(agent_group.messages),
                    "base_url": "",  # the API's address as the claim reached it (api.py)
                    "max_turns": self.max_turns,
                    "expires_at": episode.expires_at,
                }
            )
        for claim in [c for c in self.claims if now >= c.deadline]:
            self.claims.remove(claim)
            if claim.future.set_running_or_notify_cancel():
                claim.future.set_exception(
                    AgentError(
                        503,
                        "no_episode",
                        f"no task could start an episode in time: {self.waiting_reason or 'no task available'}",
                    )
                )

    def _unclaimed(self) -> Episode | None:
        for agent_group in self.groups.values():
            if (lag := self.lag(agent_group.group)) > self.k:  # no turn of it could start: give it up
                self._give_up(agent_group, "lag", stale_error(agent_group.group, lag, self.k))
                return self._unclaimed()  # the groups changed: look again
            for episode in agent_group.episodes:
                if not episode.claimed:
                    return episode
        return None

    def _open(self, group: Group, now: float) -> None:
        agent_group = AgentGroup(group, self.messages_of(group), now + self.episode_timeout_s)
        agent_group.episodes = [Episode(f"{group.group_id}.{i}", agent_group) for i in range(group.n)]
        self.groups[group.group_id] = agent_group
        for episode in agent_group.episodes:
            self.episodes[episode.id] = episode

    # ------------------------------------------------------------------ turns
    def _episode(self, episode_id: str, idle: bool = False) -> Episode:
        """The open episode ``episode_id`` (``idle``: with no completion in progress), or the error that says
        why there is none."""
        episode = self.episodes.get(episode_id)
        if episode is None:
            if episode_id in self.gone:
                raise self.gone[episode_id]
            replica = self.id_prefix.split(".", 1)[0]
            if replica and episode_id.startswith(replica + ".") and not episode_id.startswith(self.id_prefix):
                raise AgentError(
                    404,
                    "episode_lost",
                    f"episode {episode_id!r} belongs to an earlier run of {replica}, which restarted: its "
                    "group was given up and its task retried; claim a new episode",
                )
            raise AgentError(
                404, "episode_not_found", f"no open episode {episode_id!r} on this sampler replica"
            )
        if not episode.claimed:
            raise AgentError(404, "episode_not_found", f"episode {episode_id!r} was not claimed")
        if episode.finished:
            raise AgentError(409, "episode_finished", f"episode {episode_id!r} was already finished")
        if idle and episode.turn is not None:
            raise AgentError(
                409, "turn_in_progress", f"episode {episode.id!r} has a completion in progress; wait for it"
            )
        return episode

    def _turn(self, turn: Turn) -> None:
        episode = self._episode(turn.episode_id, idle=True)
        if episode.turns >= self.max_turns:
            raise AgentError(
                400,
                "max_turns_exceeded",
                f"episode {episode.id!r} has had its {self.max_turns} completions (agents.max_turns); finish it",
            )
        group = episode.group.group
        lag = self.lag(group)
        if lag > self.k:
            error = stale_error(group, lag, self.k)
            self._give_up(episode.group, "lag", error)
            raise error
        version = self.engine.loaded_version
        if version is None:
            raise AgentError(503, "no_weights", "the engine holds no policy version right now; retry")
        text = turn.prompt is not None  # a completions turn: all of an episode's turns are of one kind
        if episode.tokens is not None and text != episode.text:
            played = "completions" if episode.text else "chat completions"
            raise AgentError(400, "mixed_turns", f"episode {episode.id!r} is played with {played} only")
        context = episode.tokens.context if episode.tokens is not None else []
        try:
            if turn.prompt is not None:
                prompt = self.rule.text_turn(context, "".join(m["content"] for m in episode.log), turn.prompt)
            elif episode.tokens is None:
                prompt = self.rule.first_turn(turn.messages, turn.tools)
            else:
                prompt = self.rule.next_turn(context, episode.log, turn.messages, turn.tools, episode.tools)
        except MessageError as exc:
            raise AgentError(400, exc.code, str(exc), exc.param) from None
        episode.text = text
        sampling = turn_sampling(self.engine.max_model_len, len(prompt.ids), self.sampling, turn.sampling)
        before = (copy.deepcopy(episode.tokens), episode.log, episode.tools, episode.turns)
        if episode.tokens is None:
            episode.tokens = EpisodeTokens.first(prompt, version)
        else:
            episode.tokens.begin_turn(prompt, version)
            if prompt.break_reason is not None:
                self.on_break(prompt.break_reason)
        episode.log, episode.tools = prompt.log, turn.tools
        request_id = f"{episode.id}#{episode.turns}"
        episode.turn = InFlight(
            turn, request_id, len(episode.tokens.response.tokens), len(prompt.ids), before
        )
        self.requests[request_id] = episode
        self.engine.add(request_id, prompt.ids, sampling)

    def _cancel(self, cancel: Cancel) -> dict[str, Any]:
        episode = self.episodes.get(cancel.episode_id)
        flight = episode.turn if episode is not None else None
        if episode is None or flight is None or flight.turn is not cancel.turn:
            return {"cancelled": False}  # ended meanwhile (answered, or its group given up)
        self._end_turn(episode, AgentError(499, "cancelled", "the client went away"))
        episode.tokens, episode.log, episode.tools, episode.turns = flight.before
        self.counts["cancelled"] += 1
        return {"cancelled": True}

    # ------------------------------------------------------------------ the end of episodes and groups
    def _finish(self, finish: Finish) -> dict[str, Any]:
        episode = self._episode(finish.episode_id, idle=True)
        if episode.tokens is None or not episode.turns:
            raise AgentError(
                409,
                "episode_empty",
                f"episode {episode.id!r} has no completion to train on; make one, or abandon the episode",
            )
        episode.finished, episode.reward = True, finish.reward
        self.counts["finished"] += 1
        agent_group = episode.group
        slot = agent_group.episodes.index(episode)  # its seat is free (the sampler's requests_in_flight)
        list(agent_group.group.responses.values())[slot].finish_reason = "stop"
        if agent_group.done:
            self._complete(agent_group)
        return {"id": episode.id, "finished": True, "group_complete": agent_group.done}

    def _abandon(self, episode_id: str) -> dict[str, Any]:
        episode = self._episode(episode_id)
        error = AgentError(
            409,
            "group_abandoned",
            f"episode {episode.id!r} of this group was abandoned: the group was given up and its task retried",
        )
        self._give_up(episode.group, "agent_abandoned", error)
        return {"id": episode.id, "abandoned": True}

    def _expire(self) -> None:
        now = self.clock()
        for agent_group in list(self.groups.values()):
            late = [
                e
                for e in agent_group.episodes
                if not e.finished and (now >= e.expires_at if e.claimed else now >= agent_group.deadline)
            ]
            if late:
                episode = late[0]
                what = "was not finished" if episode.claimed else "was not claimed"
                self._give_up(
                    agent_group,
                    "agent_expired",
                    AgentError(
                        409,
                        "episode_expired",
                        f"episode {episode.id!r} {what} within agents.episode_timeout_s = "
                        f"{self.episode_timeout_s:g}s: its group was given up and its task retried",
                    ),
                )

    def _complete(self, agent_group: AgentGroup) -> None:
        group, episodes = agent_group.group, agent_group.episodes
        records = [e.tokens for e in episodes if e.tokens is not None]
        try:
            group.prompt_tokens = group_prompt(records)
        except ValueError:  # nothing to train it as a group with: its episodes began with different text
            why = "the group's episodes share no prompt token: begin every episode with the claim's messages"
            error = AgentError(409, "no_common_prompt", why)
            self._give_up(agent_group, "agent_invalid", error)
            raise error from None
        group.responses = {}
        for episode in episodes:
            assert episode.tokens is not None
            response = episode.tokens.response
            response.finish_reason = "stop"
            response.turns = episode.turns
            last = next(
                (m for m in reversed(episode.log) if m.get("role") in ("assistant", "completion")), {}
            )
            response.final_text = str(last.get("content") or "")
            response.agent_reward = episode.reward
            group.responses[episode.id] = response
        self._forget(agent_group)
        self._finished.append(group)

    def _give_up(self, agent_group: AgentGroup, reason: str, error: AgentError) -> None:
        """Give the group up (the sampler releases its admission slot and retries its task)."""
        self.abort(agent_group.group, error)
        self._failed.append((agent_group.group, reason, error.message))

    def _forget(self, agent_group: AgentGroup) -> None:
        self.groups.pop(agent_group.group.group_id, None)
        for episode in agent_group.episodes:
            self.episodes.pop(episode.id, None)
            if agent_group.failure is not None and episode.claimed:  # its client is told why, later
                self.gone[episode.id] = agent_group.failure
        while len(self.gone) > REMEMBERED:
            self.gone.popitem(last=False)
