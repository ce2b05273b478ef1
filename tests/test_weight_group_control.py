"""The collective transport's control plane over real Redis and real gloo groups: members register, the
coordinator (learner rank 0) forms epochs in the background, re-forms them when members join, leave or never
arrive, and after a failed broadcast; a sampler joins, receives, leaves a failed epoch and rejoins."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
import torch

from services.common.ports import free_port, reachable_host
from services.sampler.weights import CollectiveWeightSync
from services.weight_transport.group_control import GroupCoordinator
from services.weight_transport.receiver import CollectiveReceiver, NoRoom
from services.weight_transport.seats import GroupRegistry, Member, MemberSeat, Seat
from services.weight_transport.transport import WeightTransport
from services.weight_transport.weight_group import GroupSpec, TransferFailed, WeightGroup
from tests.sampler_helpers import DictEngine
from tests.test_collective_weights import break_link, is_version, specs_of, version_tensors
from tests.test_weight_group_nccl import form
from vcpo.v1 import weights_pb2


def _until(what: str, check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f}s"
        time.sleep(0.05)


class Receiver(threading.Thread):
    """A receiving member as a sampler's loop is one: join what the seat hands over, leave a superseded or
    broken epoch, receive every announced version. ``refuse``: leave the group at the next announcement
    instead of receiving it (a member gone mid-broadcast). ``hang``: at the next announcement, stop
    heartbeating and stand still, its connections open (a process stopped or stuck in a driver call)."""

    def __init__(self, registry: GroupRegistry, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.seat = MemberSeat(registry, Member(name), poll_s=0.05)
        self.got: list[tuple[int, int, bool]] = []  # (epoch, version, exactly the version's tensors)
        self.failures: list[str] = []
        self.refuse = False
        self.hang = False
        self.stall = False
        self.never_connect = False  # arrives at each epoch's rendezvous (its seat), never joins the group
        self.halt = threading.Event()

    def run(self) -> None:
        self.seat.start()
        group: WeightGroup | None = None
        while not self.halt.is_set():
            formed = self.seat.take()
            if formed is not None and self.never_connect:
                continue
            if formed is not None:
                if group is not None:
                    group.close()
                try:
                    group = WeightGroup(formed.spec, formed.rank_offset)
                except TransferFailed as exc:  # the epoch did not form: the next one may
                    group = None
                    self.failures.append(str(exc))
                    continue
            if group is None or group.closed or self.seat.superseded(group.spec.epoch):
                time.sleep(0.02)
                continue
            try:
                version = group.next_announcement(0.05)
                if version is None:
                    continue
                if self.refuse:
                    self.refuse = False
                    group.close()
                    continue
                if self.hang:
                    self.seat.stop()
                    self.halt.wait()
                    break
                if self.stall:  # stuck (its engine's loop in a long call), its heartbeat going on
                    self.halt.wait()
                    break
                got, tensors, _ = CollectiveReceiver(group).receive()
                self.got.append((group.spec.epoch, got, got == version and is_version(got, tensors)))
            except TransferFailed as exc:
                self.failures.append(str(exc))
        if group is not None:
            group.close()
        self.seat.stop()

    def versions(self) -> list[int]:
        return [v for _, v, _ in self.got]


@pytest.fixture
def registry(redis_client: redis.Redis) -> GroupRegistry:
    return GroupRegistry(redis_client, f"wg-{time.monotonic_ns()}", ttl_s=1.0)


@pytest.fixture
def coordinator(registry: GroupRegistry) -> Iterator[GroupCoordinator]:
    c = GroupCoordinator(registry, "127.0.0.1", "gloo", timeout_s=20, form_timeout_s=3, bucket_bytes=8192)
    yield c
    c.close()


def _publish(coordinator: GroupCoordinator, version: int) -> None:
    publisher = coordinator.publisher()
    assert publisher is not None
    tensors = version_tensors(version)
    publisher.send(version, specs_of(tensors), iter(tensors))


@contextmanager
def _stopping(coordinator: GroupCoordinator, *receivers: Receiver) -> Iterator[None]:
    """On the way out: the receivers halted and joined (those started), then the coordinator closed."""
    try:
        yield
    finally:
        for r in receivers:
            r.halt.set()
        for r in receivers:
            if r.is_alive():
                r.join(10)
        coordinator.close()


def _ipv6_route() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s:
            s.connect(("2001:db8::1", 9))
        return True
    except OSError:
        return False


def test_the_group_host_follows_the_redis_hosts_address_family() -> None:
    """The learner's address for the weight group is that of its route to Redis, IPv6 as well as IPv4 (an
    IPv6-only cluster's Redis resolves to IPv6 only: an IPv4 socket could not even look the route up); a
    group forms and moves bytes at that address. A Redis host that does not resolve names the setting that
    takes the guess's place."""
    assert reachable_host("redis://127.0.0.1:6379/0", "weight_broker.group_host") == "127.0.0.1"
    with pytest.raises(ValueError, match=r"'no-such-host\.invalid'.*set weight_broker\.group_host"):
        reachable_host("redis://no-such-host.invalid:6379/0", "weight_broker.group_host")
    if not _ipv6_route():
        pytest.skip("this machine has no IPv6 route")
    host = reachable_host(
        "redis://[2001:db8::1]:6379/0", "weight_broker.group_host"
    )  # a documentation address: only its route is used
    assert ":" in host, host
    groups = form(GroupSpec(host, free_port(), world_size=2, timeout_s=20))
    sent, got = torch.arange(8.0), torch.zeros(8)
    works = [groups[0].broadcast(sent), groups[1].broadcast(got)]
    for g, w in zip(groups, works, strict=True):
        g.wait(w)
    assert torch.equal(got, sent)
    for g in groups:
        g.close()


def test_the_registry_sees_members_until_they_leave_or_their_heartbeat_expires(
    registry: GroupRegistry,
) -> None:
    registry.heartbeat(Member("a", 2, "sampler", "cuda"))
    registry.heartbeat(Member("b"))
    assert registry.live() == {"a": Member("a", 2, "sampler", "cuda"), "b": Member("b")}
    registry.leave("b")
    assert set(registry.live()) == {"a"}
    time.sleep(1.2)  # ttl 1 s, no heartbeat
    assert registry.live() == {}
    assert registry.next_epoch() + 1 == registry.next_epoch()  # epochs never repeat
    with pytest.raises(ValueError, match="ttl"):
        GroupRegistry(registry.client, "x", ttl_s=0)


def test_epochs_form_in_the_background_and_follow_joins_leaves_and_failures(
    registry: GroupRegistry, coordinator: GroupCoordinator
) -> None:
    assert coordinator.publisher() is None  # nobody to send to: the learner publishes through the broker

    a, b = Receiver(registry, "sampler-0.a"), Receiver(registry, "sampler-1.b")
    for t in (a, b):
        t.start()
    try:
        _until("a formed group", lambda: coordinator.wait_formed(0.1))
        assert coordinator.members == {"sampler-0.a", "sampler-1.b"}
        first = coordinator.epoch
        _publish(coordinator, 1)
        _until("version 1 everywhere", lambda: a.versions() == [1] and b.versions() == [1])
        assert all(exact for _, _, exact in a.got + b.got)

        # a sampler joins: the next publish finds the members changed, goes through the broker while the new
        # epoch forms, and the epoch after carries every member
        c = Receiver(registry, "sampler-2.c")
        c.start()
        _until("the new member registered", lambda: "sampler-2.c" in registry.live())
        assert coordinator.publisher() is None  # forming: this version takes the broker's path
        _until("the re-formed group", lambda: coordinator.wait_formed(0.1))
        assert coordinator.epoch > first and "sampler-2.c" in coordinator.members
        _publish(coordinator, 2)
        _until("version 2 everywhere", lambda: all(r.versions()[-1:] == [2] for r in (a, b, c)))

        # a member drops out mid-broadcast: the version fails on every member, none keeps it
        b.refuse = True
        with pytest.raises(TransferFailed):
            _publish(coordinator, 3)
        coordinator.failed(TransferFailed("version 3"))
        time.sleep(0.5)
        assert 3 not in a.versions() + c.versions()
        # it forms again (b is still alive and rejoins), and the run goes on
        _until("the group after the failure", lambda: coordinator.wait_formed(0.1))
        _publish(coordinator, 4)
        _until("version 4 everywhere", lambda: all(r.versions()[-1:] == [4] for r in (a, b, c)))

        # a member leaves: re-formed without it
        c.halt.set()
        c.join(10)
        _until(
            "the group without the member that left",
            lambda: coordinator.wait_formed(0.1) and "sampler-2.c" not in coordinator.members,
        )
        _publish(coordinator, 5)
        _until("version 5", lambda: a.versions()[-1:] == [5] and b.versions()[-1:] == [5])
    finally:
        for r in (a, b):
            r.halt.set()
        for t in (a, b):
            t.join(10)


def test_a_member_that_never_arrives_is_left_out_and_the_rest_form(
    registry: GroupRegistry, coordinator: GroupCoordinator
) -> None:
    registry.heartbeat(Member("sampler-9.ghost"))  # registered, then never at the rendezvous
    registry.ttl_s = 30.0  # the ghost stays "alive" through the attempts
    a = Receiver(registry, "sampler-0.a")
    a.start()
    events: list[str] = []
    coordinator.on_event = events.append
    try:
        _until("a group without the ghost", lambda: coordinator.wait_formed(0.1), timeout_s=40)
        assert coordinator.members == {"sampler-0.a"}
        assert events[0] == "form_failed" and events[-1] == "formed"
        _publish(coordinator, 7)
        _until("version 7", lambda: a.versions() == [7])
    finally:
        a.halt.set()
        a.join(10)


def test_a_member_that_hangs_mid_broadcast_fails_it_once_its_heartbeat_expires(
    registry: GroupRegistry,
) -> None:
    """A member that stops answering with its connections open (a stopped process; under NCCL between the GPUs
    of one node, a dead one too) would hold every rank in the broadcast until the group's timeout (60 s here):
    rank 0 fails it once the member's heartbeat has expired (1 s), and the others give up with it."""
    coordinator = GroupCoordinator(
        registry, "127.0.0.1", "gloo", timeout_s=60, form_timeout_s=3, bucket_bytes=8192
    )
    a, b = Receiver(registry, "sampler-0.a"), Receiver(registry, "sampler-1.b")
    for r in (a, b):
        r.start()
    with _stopping(coordinator, a, b):
        _until("a formed group", lambda: coordinator.wait_formed(0.1))
        _publish(coordinator, 1)
        _until("version 1", lambda: a.versions() == [1] and b.versions() == [1])
        b.hang = True
        t0 = time.monotonic()
        with pytest.raises(TransferFailed, match=r"version 2: .*member sampler-1\.b stopped heartbeating"):
            _publish(coordinator, 2)
        assert time.monotonic() - t0 < 10, time.monotonic() - t0
        _until("a's part given up", lambda: any("version 2" in f for f in a.failures), timeout_s=5)
        assert a.versions() == [1]  # nothing applied


@pytest.mark.slow
def test_a_member_that_arrives_but_never_connects_is_left_out_longer_each_time_and_the_rest_form(
    registry: GroupRegistry,
) -> None:
    """Every member arrived, and the ranks did not connect (one on a node whose NCCL interface is wrong):
    nothing names the culprit, and none was left out, so every attempt failed alike, each holding every
    sampler's loop in its join for up to the forming timeout. The members new since the last epoch that formed
    are left out, twice as long each time in a row: the others form and take versions."""
    coordinator = GroupCoordinator(
        registry, "127.0.0.1", "gloo", timeout_s=20, form_timeout_s=2, bucket_bytes=8192
    )
    a, b = Receiver(registry, "sampler-0.a"), Receiver(registry, "sampler-1.b")
    b.never_connect = True
    a.start()
    with _stopping(coordinator, a, b):
        _until("a group of a", lambda: coordinator.wait_formed(0.1))
        first = coordinator.epoch

        def strikes() -> int:  # rank 0's look between steps: forms, re-forms, takes what forming gave
            coordinator.publisher()
            return coordinator._strikes.get("sampler-1.b", 0)

        b.start()  # joins the registry: the group re-forms with it, and fails
        _until("b left out once", lambda: strikes() == 1, timeout_s=20)
        _until("a group of a again", lambda: coordinator.wait_formed(0.1) and coordinator.epoch > first)
        assert coordinator.members == {"sampler-0.a"}
        _publish(coordinator, 3)
        _until("version 3", lambda: 3 in a.versions())
        # back in after 3 heartbeat lifetimes (3 s), it breaks the next epoch too: left out twice as long
        _until("b left out twice", lambda: strikes() == 2, timeout_s=30)
        assert coordinator._excluded["sampler-1.b"] - time.monotonic() > 4.0
        assert "sampler-0.a" not in coordinator._strikes  # in the epochs that formed: never blamed


@pytest.mark.slow
def test_where_every_member_is_new_a_failed_connect_leaves_all_out_and_dead_ids_go_once_expired(
    registry: GroupRegistry,
) -> None:
    """The first epoch's ranks did not connect: every member is new, so all are left out together, longer each
    time in a row (the attempts, each holding every sampler's loop in its join, come further apart). An id
    absent from the registry for a moment (Redis restarted: its set comes back with the next heartbeats)
    keeps its record until its exclusion has run out; then it is forgotten."""
    coordinator = GroupCoordinator(registry, "127.0.0.1", "gloo", timeout_s=20, form_timeout_s=5)
    events: list[str] = []
    coordinator.on_event = events.append
    a, b = Receiver(registry, "sampler-0.a"), Receiver(registry, "sampler-1.b")
    b.never_connect = True
    for r in (a, b):
        r.start()
    try:
        _until("both registered", lambda: len(registry.live()) == 2)  # before rank 0 first looks
        _until(
            "a failed forming", lambda: (coordinator.publisher(), "form_failed" in events)[1], timeout_s=30
        )
        assert coordinator._strikes == {"sampler-0.a": 1, "sampler-1.b": 1}
    finally:
        for r in (a, b):
            r.halt.set()
        for r in (a, b):
            r.join(10)
    _until("both gone", lambda: registry.live() == {})
    coordinator._eligible()  # gone, and still left out: kept
    assert set(coordinator._strikes) == {"sampler-0.a", "sampler-1.b"}
    coordinator._excluded["sampler-1.b"] = time.monotonic() - 1
    coordinator._eligible()
    assert set(coordinator._strikes) == {"sampler-0.a"} and "sampler-1.b" not in coordinator._excluded
    coordinator.close()


def test_a_member_arriving_after_its_epoch_was_given_up_stops_waiting_at_once(
    registry: GroupRegistry,
) -> None:
    """Rank 0 stops waiting for a member that has not arrived (its sampler's loop was in a long load) and
    marks the epoch given up: the member, arriving later, stops at once instead of waiting out the forming
    timeout (its engine's loop standing still) for an epoch that can no longer form."""
    import torch.distributed as dist

    from services.weight_transport.weight_group import arrive, open_store

    coordinator = GroupCoordinator(registry, "127.0.0.1", "gloo", timeout_s=20, form_timeout_s=2)
    events: list[str] = []
    coordinator.on_event = events.append
    registry.heartbeat(Member("sampler-0.late"))  # registered, its loop busy elsewhere
    try:
        _until(
            "a failed forming", lambda: (coordinator.publisher(), "form_failed" in events)[1], timeout_s=30
        )
        current = registry.spec()
        assert current is not None
        spec, ranks, _ = current
        store = dist.PrefixStore(spec.prefix(), open_store(spec))
        t0 = time.monotonic()
        with pytest.raises(TransferFailed, match=r"given up .*missing: \['sampler-0.late'\]"):
            arrive(store, "members_arrived", len(ranks) + 1, spec.form_timeout_s)
        assert time.monotonic() - t0 < 1.0
    finally:
        coordinator.close()


@pytest.mark.slow
def test_a_background_broadcast_that_fails_as_its_epoch_is_dropped_is_counted(
    registry: GroupRegistry,
) -> None:
    """Rank 0's idle check (``publisher()``) can see the members change (a sampler gone mid-broadcast) before
    the broadcast thread sees it fail. Dropping the epoch then waits for that broadcast, whose failure was only
    logged: not counted, so the learner never republished the version it lost (with k = 0 the run waited for
    good). It is counted as any failed broadcast is."""
    events: list[str] = []
    coordinator = GroupCoordinator(
        registry,
        "127.0.0.1",
        "gloo",
        timeout_s=60,
        form_timeout_s=3,
        bucket_bytes=8192,
        on_event=events.append,
    )
    a, b = Receiver(registry, "sampler-0.a"), Receiver(registry, "sampler-1.b")
    for r in (a, b):
        r.start()
    with _stopping(coordinator, a, b):
        _until("a formed group", lambda: coordinator.wait_formed(0.1))
        _publish(coordinator, 1)
        _until("version 1", lambda: a.versions() == [1] and b.versions() == [1])
        assert coordinator._formed is not None
        coordinator._formed.group.alive_every_s = (
            5.0  # its own look at the members comes after the idle check
        )
        b.hang = True  # leaves the registry at the announcement, its connections open
        publisher = coordinator.publisher()
        assert publisher is not None
        tensors = version_tensors(2)
        publisher.send_background(2, specs_of(tensors), iter(tensors))
        _until("b gone from the registry", lambda: "sampler-1.b" not in registry.live(), timeout_s=10)
        coordinator.publisher()  # the members changed: the epoch is dropped once its broadcast has ended
        assert coordinator.failures == 1 and events.count("broadcast_failed") == 1, events
        coordinator.publisher()
        assert coordinator.failures == 1  # once
        assert a.versions() == [1]  # nothing applied


def test_a_failure_counted_by_failed_is_not_counted_again_when_its_broadcast_ends(
    registry: GroupRegistry,
) -> None:
    """failed() counts a failure and drops the epoch, which waits for the broadcast still pending; that
    broadcast's own failure, returned by the publisher's close, is the same failure."""
    events: list[str] = []
    coordinator = GroupCoordinator(
        registry,
        "127.0.0.1",
        "gloo",
        timeout_s=60,
        form_timeout_s=3,
        bucket_bytes=8192,
        on_event=events.append,
    )
    a, b = Receiver(registry, "sampler-0.a"), Receiver(registry, "sampler-1.b")
    for r in (a, b):
        r.start()
    with _stopping(coordinator, a, b):
        _until("a formed group", lambda: coordinator.wait_formed(0.1))
        b.hang = True
        publisher = coordinator.publisher()
        assert publisher is not None
        tensors = version_tensors(2)
        publisher.send_background(2, specs_of(tensors), iter(tensors))
        coordinator.failed(TransferFailed("epoch closed after a failed broadcast"))  # as publisher() calls it
        assert publisher._pending is None  # the drop waited for the broadcast, which failed
        assert coordinator.failures == 1 and events.count("broadcast_failed") == 1, events


# ---------------------------------------------------------------------------------------------- the sampler side
class GroupEngine(DictEngine):
    """An engine whose "model" is a dict of tensors, with the collective methods of VllmEngine over a real
    weight group joined in this process (the real engine: tests/test_sampler_engine.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.group: WeightGroup | None = None
        self.collective_staged: int | None = None
        self._received: list[tuple[str, torch.Tensor]] = []
        self._work: threading.Thread | None = None
        self._error: Exception | None = None
        self._staging: int | None = None

    def begin_join(self, init: dict[str, Any]) -> None:  # the workers join on a thread of their own
        if self.group is not None:
            self.group.close()
        fields = {k: v for k, v in init.items() if k != "rank_offset"}
        self._begin(
            lambda: setattr(self, "group", WeightGroup(GroupSpec(**fields), int(init["rank_offset"])))
        )

    def begin_receive(self, version: int) -> None:
        assert self.group is not None
        self.collective_staged = None

        def receive() -> None:
            got, self._received, _ = CollectiveReceiver(self.group).receive()  # type: ignore[arg-type]
            assert got == version
            self._staging = version

        self._begin(receive)

    def _begin(self, work: Callable[[], None]) -> None:
        def run() -> None:
            try:
                work()
            except Exception as exc:
                self._error = exc

        self._error, self._staging = None, None
        self._work = threading.Thread(target=run, daemon=True)
        self._work.start()

    def weight_work_done(self) -> bool:
        if self._work is None or self._work.is_alive():
            return self._work is None
        self._work = None
        if self._error is not None:
            raise self._error
        self.collective_staged = self._staging
        return True

    def apply_collective(self, version: int) -> float:
        assert self.collective_staged == version
        self.collective_staged, self.model, self.loaded_version = None, dict(self._received), version
        return 0.0

    def leave_weight_group(self, why: str | None = None) -> None:  # as the vLLM engine's workers leave
        if self.group is not None and why is not None and not self.group.closed:
            self.group.part_failed(f"it left the group: {why}")
        if self.group is not None:
            self.group.close()
        if self._work is not None:  # a receive under way fails once its group is closed
            self._work.join(10)
            self._work = None


class BrokerPath(WeightTransport):
    """The broker's path as the weight sync sees it: the versions it holds, each fetch counted."""

    where = "test broker"

    def __init__(self) -> None:
        self.held: list[int] = []
        self.fetched: list[int] = []

    def latest(self) -> int | None:
        return max(self.held, default=None)

    def fetch(self, sink: Any, version: int | None = None, start_tensor: str = "") -> Any:
        version = self.latest() if version is None else version
        assert version in self.held
        self.fetched.append(version)
        for name, tensor in version_tensors(version):
            sink(name, tensor)
        return weights_pb2.VersionManifest(policy_version=version, total_bytes=1)

    def publish_once(self, version: int, specs: Any, tensors: Any) -> Any:
        raise NotImplementedError

    def _fetch_stream(self, version: int | None, start_tensor: str) -> Any:
        raise NotImplementedError

    def is_transient(self, exc: BaseException) -> bool:
        return False

    def versions(self) -> list[Any]:
        return []


@contextmanager
def _sampler_loop(sync: CollectiveWeightSync, engine: GroupEngine) -> Iterator[list[Exception]]:
    """The sampler loop's weight step on a thread of its own (pump, then apply what is ready), its errors
    collected; on the way out the loop halted, ``sync`` (started by the caller) stopped, the engine's group
    closed."""
    halt, errors = threading.Event(), []

    def loop() -> None:
        while not halt.is_set():
            try:
                sync.pump()
                version = sync.ready()
                if version is not None:
                    sync.apply(version)
            except Exception as exc:  # pragma: no cover - reported by the callers' assertions
                errors.append(exc)
            time.sleep(0.005)

    looper = threading.Thread(target=loop, daemon=True)
    looper.start()
    try:
        yield errors
    finally:
        halt.set()
        looper.join(10)
        sync.stop()
        if engine.group is not None:
            engine.group.close()


def test_a_sampler_joins_receives_applies_leaves_a_failed_epoch_and_rejoins(
    registry: GroupRegistry, coordinator: GroupCoordinator
) -> None:
    engine, broker = GroupEngine(), BrokerPath()
    failures: list[int] = []
    sync = CollectiveWeightSync(
        engine,
        broker,
        None,
        MemberSeat(registry, Member("sampler-0.s"), poll_s=0.05),
        poll_interval_s=0.05,
        on_failure=lambda: failures.append(1),
    )

    def serving(version: int) -> Callable[[], bool]:
        return lambda: engine.loaded_version == version and is_version(version, list(engine.model.items()))

    broker.held.append(1)  # published through the broker before any group exists
    sync.start()
    assert registry.live() == {}  # a member once it serves a version: it catches up from the broker first
    with _sampler_loop(sync, engine) as errors:
        _until("version 1 over the broker's path", serving(1))
        assert sync.last_path == "broker" and broker.fetched == [1]

        _until("a group with the sampler", lambda: coordinator.wait_formed(0.1))
        _until("the sampler joined", lambda: sync.epoch == coordinator.epoch)
        _publish(coordinator, 2)
        broker.held.append(2)  # and the broker holds it too (as after a catch-up republished it)
        _until("version 2 through the group", serving(2))
        assert sync.last_path == "collective" and sync.received == 2
        time.sleep(0.3)
        assert broker.fetched == [1]  # what the group delivered is not fetched again

        # a source that breaks raises before anything is announced: the sampler stays in its epoch
        publisher = coordinator.publisher()
        assert publisher is not None
        tensors = version_tensors(3)
        with pytest.raises(ValueError, match="the source ended"):
            publisher.send(3, specs_of(tensors), iter(tensors[:-1]))
        time.sleep(0.3)
        assert sync.epoch == coordinator.epoch and sync.broadcast_failures == 0 and failures == []
        # a broadcast that fails part-way: the sampler leaves the epoch, keeps version 2, counts it
        break_link(publisher.group)
        with pytest.raises(TransferFailed, match="Connection reset by peer"):
            publisher.send(3, specs_of(tensors), iter(tensors))
        _until("the sampler left the failed epoch", lambda: sync.epoch == 0)
        assert failures == [1] and sync.broadcast_failures == 1 and "failed" in sync.error
        assert engine.loaded_version == 2 and engine.collective_staged is None
        first = coordinator.epoch
        coordinator.failed(TransferFailed("version 3"))

        broker.held.append(4)  # the learner's next version goes through the broker meanwhile
        _until("version 4 over the broker's path", serving(4))
        assert sync.last_path == "broker"

        _until("a new epoch", lambda: coordinator.wait_formed(0.1) and coordinator.epoch > first)
        _until("the sampler rejoined", lambda: sync.epoch == coordinator.epoch)
        _publish(coordinator, 5)
        _until("version 5 through the new epoch", serving(5))
        assert sync.last_path == "collective" and not errors


def test_a_sampler_whose_device_has_no_room_for_a_version_leaves_the_group_for_good(
    registry: GroupRegistry, coordinator: GroupCoordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A version that does not fit beside the engine fails that one broadcast for every rank; the sampler then
    takes itself out of the weight group for good (deregistered, never seated again) and takes its versions
    through the broker, instead of failing every later broadcast for every engine in the group."""
    engine, broker = GroupEngine(), BrokerPath()
    sync = CollectiveWeightSync(
        engine, broker, None, MemberSeat(registry, Member("sampler-0.s"), poll_s=0.05), poll_interval_s=0.05
    )

    def no_room(self: CollectiveReceiver, layout: Any, version: int) -> Any:
        raise NoRoom(f"version {version} (1.00 GiB) does not fit on cuda:0 beside the engine")

    broker.held.append(1)
    sync.start()
    with _sampler_loop(sync, engine) as errors:
        _until("version 1 over the broker's path", lambda: engine.loaded_version == 1)
        _until("a group with the sampler", lambda: coordinator.wait_formed(0.1))
        _until("the sampler joined", lambda: sync.epoch == coordinator.epoch)
        monkeypatch.setattr(CollectiveReceiver, "_buffers", no_room)
        with pytest.raises(TransferFailed, match="does not fit on cuda:0"):
            _publish(coordinator, 2)
        _until("the sampler withdrew", lambda: sync.withdrawn is not None)
        assert "does not fit on cuda:0" in sync.withdrawn and sync.broadcast_failures == 1
        _until("its registration gone", lambda: registry.live() == {})
        broker.held.append(2)  # the version the group did not carry, through the broker
        _until("version 2 over the broker's path", lambda: engine.loaded_version == 2)
        time.sleep(1.5)  # heartbeat lifetimes (1 s): a member seated again would be registered by now
        assert registry.live() == {} and sync.epoch == 0 and not errors


def test_the_learners_coordinator_from_its_config_bounds_its_waits_and_hands_out_publishers(
    redis_client: redis.Redis, redis_url: str
) -> None:
    """The learner's coordinator built from ``weight_broker``: its group timeout, bounded by what the learner's
    other ranks can wait for rank 0; and the publisher of the epoch it forms delivers a version exactly."""
    from services.weight_transport.config import WeightBrokerConfig
    from services.weight_transport.group_control import coordinator_from_config

    run_id = f"wg-config-{time.monotonic_ns()}"
    wb = WeightBrokerConfig(
        group_timeout_s=20,
        group_form_timeout_s=3,
        group_member_ttl_s=1.0,
        group_settle_s=0.0,  # one member: nothing to wait for
    )
    coordinator = coordinator_from_config(wb, redis_url, run_id, redis_client, torch.device("cpu"))
    off = coordinator_from_config(WeightBrokerConfig(), redis_url, run_id, redis_client, torch.device("cpu"))
    assert (coordinator.timeout_s, off.timeout_s, off.wait_budget_s) == (20, 120, None)
    off.close()
    # a group's steps never outlast what the learner's other ranks can wait for rank 0 (learner.collective_
    # timeout_s / 3): under NCCL each is a kernel on rank 0's GPU, which its training step waits for
    bounded = coordinator_from_config(
        wb, redis_url, run_id, redis_client, torch.device("cpu"), wait_budget_s=10
    )
    assert (bounded.timeout_s, bounded.wait_budget_s) == (10, 10)
    bounded.close()
    a = Receiver(GroupRegistry(redis_client, run_id, ttl_s=1.0), "sampler-0.a")
    a.start()
    try:
        _until("a group", lambda: coordinator.wait_formed(0.1), timeout_s=40)
        publisher = coordinator.publisher()
        assert publisher is not None
        tensors = version_tensors(3)
        assert publisher.send(3, specs_of(tensors), iter(tensors)).version == 3
        _until("version 3", lambda: a.got == [(coordinator.epoch, 3, True)])
    finally:
        a.halt.set()
        a.join(10)
        coordinator.close()


def test_rank_0_waits_for_a_broadcast_in_flight_no_longer_than_its_budget(registry: GroupRegistry) -> None:
    """The other learner ranks wait for rank 0 inside a collective while it waits for the broadcast in flight
    (before the next version, or to leave the epoch); past ``learner.collective_timeout_s`` they would fail and
    the learner restart. A receiver stuck in its loop with its heartbeat alive held that broadcast until the
    group's timeout. Past the budget the broadcast is aborted and counted, and its version's successor goes
    through the broker."""
    events: list[str] = []
    coordinator = GroupCoordinator(
        registry,
        "127.0.0.1",
        "gloo",
        timeout_s=30,
        form_timeout_s=3,
        bucket_bytes=8192,
        on_event=events.append,
        wait_budget_s=2.0,
    )
    a = Receiver(registry, "sampler-0.a")
    a.start()
    try:
        _until("a group", lambda: coordinator.wait_formed(0.1), timeout_s=40)
        publisher = coordinator.publisher(ready=True)
        assert publisher is not None  # nothing in flight: ready at once
        a.stall = True
        tensors = version_tensors(5)
        publisher.send_background(5, specs_of(tensors), iter(tensors))
        t0 = time.monotonic()
        assert coordinator.publisher(ready=True) is None
        waited = time.monotonic() - t0
        assert 2.0 <= waited < 10.0, waited  # the budget, not the group's 30 s timeout
        assert coordinator.failures == 1 and events.count("broadcast_failed") == 1
        assert publisher._pending is None and coordinator.members == frozenset()
    finally:
        a.halt.set()
        a.join(10)
        coordinator.close()


def test_every_epochs_publisher_stages_in_the_coordinators_one_buffer(registry: GroupRegistry) -> None:
    """A background broadcast stages the version in a host buffer of the model's size, page-locked under CUDA.
    Each epoch's publisher made its own: after every re-forming (a sampler joining, leaving, restarting) rank
    0 mapped and page-locked the whole model again, tens of seconds for a 70B one, while the other learner
    ranks waited for it in the gathers. The coordinator keeps one for every epoch, and lets it go at close."""
    coordinator = GroupCoordinator(
        registry, "127.0.0.1", "gloo", timeout_s=20, form_timeout_s=3, bucket_bytes=8192
    )
    a = Receiver(registry, "sampler-0.a")
    a.start()
    buffers = []
    try:
        for version in (5, 6):
            _until("a group", lambda: coordinator.wait_formed(0.1), timeout_s=40)
            publisher = coordinator.publisher()
            assert publisher is not None
            tensors = version_tensors(version)
            publisher.send_background(version, specs_of(tensors), iter(tensors))
            publisher.wait()
            _until(f"version {version}", lambda v=version: v in a.versions())  # type: ignore[misc]
            buffers.append((publisher._staging, publisher._staging._tensor.data_ptr()))
            coordinator.failed(TransferFailed(f"version {version + 10}: broadcast failed"))  # a new epoch
        (first, at), (second, again) = buffers
        assert second is first and again == at  # the same memory, not made again
        assert first._tensor is not None  # kept while the epoch is dropped
    finally:
        a.halt.set()
        a.join(10)
        coordinator.close()
    assert buffers[0][0]._tensor is None


def test_epochs_keep_forming_on_a_fixed_port_range_however_many_there_are(registry: GroupRegistry) -> None:
    """Helm fixes the rendezvous port (group_port, a range of 8). A closed group keeps its store, so a store
    per epoch held its port for the learner's life: after as many epochs as the range has ports (a sampler
    joining, leaving or restarting, a failed broadcast: each drops one), no group formed again and every
    version went through the broker. One store serves every epoch, on one port of the range."""
    coordinator = GroupCoordinator(
        registry,
        "127.0.0.1",
        "gloo",
        port=free_port(),
        port_range=2,
        timeout_s=20,
        form_timeout_s=3,
        bucket_bytes=8192,
    )
    a = Receiver(registry, "sampler-0.a")
    a.start()
    ports = set()
    try:
        for version in range(1, 5):  # twice as many epochs as the range has ports
            _until(f"epoch {version}", lambda: coordinator.wait_formed(0.1), timeout_s=40)
            formed = coordinator._formed
            assert formed is not None
            ports.add(formed.group.spec.port)
            _publish(coordinator, version)
            _until(f"version {version}", lambda v=version: v in a.versions())
            coordinator.failed(TransferFailed(f"version {version}: dropped to form the next epoch"))
            coordinator._next_attempt = 0.0  # no need to wait out the member's heartbeat here
        assert len(ports) == 1 and coordinator.epoch >= 4
    finally:
        a.halt.set()
        a.join(10)
        coordinator.close()


def test_a_broadcast_version_whose_load_failed_is_fetched_from_the_broker_though_it_was_passed_over() -> None:
    """The fetch thread passes over a version the group delivered (version 5, announced by the broker too), and a
    refusal is final. When loading the delivered copy fails (finish_weight_update raising in a worker), the
    broker's copy is wanted again: it used to stay refused, and the sampler admitted nothing until a newer
    version came (with one sampler, none did)."""
    from types import SimpleNamespace

    class NoLoad:
        collective_staged, loaded_version = 5, 4

        def apply_collective(self, version: int) -> float:
            raise RuntimeError("finish_weight_update failed in worker(s) 1 of 2")

    renewed: list[bool] = []
    seat = SimpleNamespace(start=lambda: None, stop=lambda: None, renew=lambda: renewed.append(True))
    sync = CollectiveWeightSync(NoLoad(), SimpleNamespace(), None, seat)  # type: ignore[arg-type]
    sync.received = 5
    assert not sync._wants(5) and sync.declined == 5  # delivered: not fetched
    with pytest.raises(RuntimeError, match="finish_weight_update failed"):
        sync.apply(5)
    assert sync.received is None and sync._wants(5)
    assert "version 5 could not be loaded" in sync.error
    # registered again under a new id: learner rank 0 gives the broker version 5 for it (its broker under NCCL
    # holds only what the group did not carry), as it does for a restarted sampler
    assert renewed == [True]


def test_a_sampler_that_gives_up_on_its_epoch_takes_its_workers_out_of_the_group() -> None:
    """A join that failed in some worker, a receive that failed to start or failed in a worker's thread, a
    superseded epoch: the workers leave their groups too (the first two telling every rank why). They stayed in them:
    the learner's next broadcast then waited for them until the group's timeout."""
    from types import SimpleNamespace

    left: list[str | None] = []

    def join(init: dict[str, Any]) -> None:
        raise RuntimeError("init_weight_transfer_engine failed in worker(s) 1 of 2: no such host")

    def stage(version: int) -> None:
        raise RuntimeError(
            f"update_weights failed in worker(s) 0 of 2: version {version} is not the announced"
        )

    engine = SimpleNamespace(
        loaded_version=1,
        collective_staged=None,
        begin_join=join,
        begin_receive=stage,
        leave_weight_group=left.append,
    )
    seat = Seat(GroupSpec("127.0.0.1", 1, 3, epoch=4), 1, 8192)
    ready = [seat]
    seats = SimpleNamespace(
        start=lambda: None,
        stop=lambda: None,
        take=lambda: ready.pop() if ready else None,
        superseded=lambda epoch: False,
        newest_epoch=4,
    )
    sync = CollectiveWeightSync(engine, SimpleNamespace(latest=lambda: None), None, seats)  # type: ignore[arg-type]
    sync.pump()
    assert sync.watch is None and left == [sync.error] and "could not join weight group epoch 4" in sync.error

    watch = SimpleNamespace(next=lambda timeout: 7)
    sync.watch, sync.epoch = watch, 4  # type: ignore[assignment]
    sync.pump()
    assert sync.watch is None and left[1] == sync.error and "version 7 is not the announced" in str(left[1])

    sync.watch, sync.epoch = watch, 4  # type: ignore[assignment]
    seats.superseded = lambda epoch: True
    sync.pump()
    assert sync.watch is None and left[2] is None and len(left) == 3  # let go of, no failure to tell

    def unreachable(timeout: float) -> int:
        raise TransferFailed("the weight group's store is unreachable: Connection refused")

    # the epoch's failure seen by its watch: marked already, or its store (rank 0's) gone, which a mark would
    # wait for until the store's timeout, inside the call into every worker: left without telling
    sync.watch, sync.epoch, sync._last_look = SimpleNamespace(next=unreachable), 4, 0.0  # type: ignore[assignment]
    seats.superseded = lambda epoch: False
    sync.pump()
    assert sync.watch is None and left[3] is None and "store is unreachable" in sync.error

    # a receive that began and then failed in a worker (its own thread): the sampler learns it at a later
    # turn, between engine steps, and leaves telling every rank
    def broken() -> bool:
        raise RuntimeError("receive failed in worker(s) 1 of 2: out of memory")

    engine.begin_receive, engine.weight_work_done = lambda version: None, broken
    sync.watch, sync.epoch, sync._last_look = watch, 4, 0.0  # type: ignore[assignment]
    sync.pump()
    assert sync._busy is not None and sync.watch is watch and len(left) == 4  # under way: the loop goes on
    sync._last_look = 0.0
    sync.pump()
    assert (
        sync._busy is None
        and sync.watch is None
        and "version 7" in str(left[4])
        and "out of memory" in str(left[4])
    )


def test_epoch_numbers_never_go_back_though_the_counter_does(registry: GroupRegistry) -> None:
    """Redis restarted having lost its last writes: the counter is behind the epochs made. A reused number
    would meet the old epoch's keys in the coordinator's rendezvous store, and samplers that saw it skip it."""
    assert registry.next_epoch() == 1 and registry.next_epoch(after=1) == 2
    registry.client.delete(f"{registry.prefix}:epoch")  # as a restart without the last writes leaves it
    assert registry.next_epoch(after=2) == 3 and registry.next_epoch(after=3) == 4  # and stored: 4 next


def test_a_seat_taken_after_a_newer_epoch_formed_is_not_joined(registry: GroupRegistry) -> None:
    """A sampler's loop busy past the forming timeout takes its seat late: rank 0 gave that epoch up and wrote
    a newer one. Joining it would wait out the forming timeout again for ranks that left."""
    seat = MemberSeat(registry, Member("sampler-0.a"), poll_s=0.05)
    seat._ready = Seat(GroupSpec("127.0.0.1", 1, 2, epoch=4), 1, 8192)
    seat.newest_epoch = 5
    assert seat.take() is None
    seat._ready = Seat(GroupSpec("127.0.0.1", 1, 2, epoch=5), 1, 8192)
    taken = seat.take()
    assert taken is not None and taken.spec.epoch == 5 and seat.take() is None


def test_a_sampler_that_could_not_register_tries_again_at_a_later_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Registering (once the engine serves a version) can meet the registry out of reach (Redis restarting):
    it is not raised through the load that succeeded, and a later turn of the loop registers."""
    from types import SimpleNamespace

    import services.sampler.weights as weights

    starts: list[str] = []

    def start() -> None:
        starts.append("tried")
        if len(starts) == 1:
            raise redis.ConnectionError("Error 111 connecting to redis:6379. Connection refused.")

    engine = SimpleNamespace(loaded_version=None, collective_staged=None)
    seat = SimpleNamespace(start=start, stop=lambda: None, take=lambda: None)
    sync = CollectiveWeightSync(engine, SimpleNamespace(latest=lambda: None), None, seat)  # type: ignore[arg-type]
    sync.start()
    sync.pump()
    assert starts == []  # no version served yet: it catches up from the broker first
    engine.loaded_version = 1
    sync.pump()  # refused: logged, not raised
    sync.pump()  # not again at once
    assert starts == ["tried"] and not sync._seated
    monkeypatch.setattr(weights, "SEAT_RETRY_S", 0.0)
    sync.pump()
    assert starts == ["tried", "tried"] and sync._seated
    sync.stop()


def test_a_heartbeat_that_races_a_renew_leaves_only_the_new_id(registry: GroupRegistry) -> None:
    """The heartbeat thread read the member before renew() replaced it, and heartbeat it after renew() left
    it: the old id was registered again, and the coordinator saw a member that is gone."""
    seat = MemberSeat(registry, Member("sampler-0.a1b2c3d4"))
    real, raced = registry.heartbeat, []

    def renewed_meanwhile(member: Member) -> None:
        if member.id == "sampler-0.a1b2c3d4" and not raced:
            raced.append(True)
            seat.renew()  # between the heartbeat thread's read of the member and its write
        real(member)

    registry.heartbeat = renewed_meanwhile  # type: ignore[method-assign]
    seat._beat()
    assert raced and set(registry.live()) == {seat.member.id} != {"sampler-0.a1b2c3d4"}
    registry.leave(seat.member.id)


def test_a_renewed_seat_is_a_new_member_and_the_old_one_is_gone(registry: GroupRegistry) -> None:
    seat = MemberSeat(registry, Member("sampler-0.a1b2c3d4", 2, "sampler", "cuda"))
    seat.start()
    try:
        old = seat.member.id
        seat.renew()
        new = seat.member
        assert new.id != old and new.id.startswith("sampler-0.") and (new.workers, new.devices) == (2, "cuda")
        assert set(registry.live()) == {new.id}
    finally:
        seat.stop()
    assert registry.live() == {}


def test_a_background_broadcasts_own_error_is_a_failed_broadcast_not_the_next_versions() -> None:
    """The background broadcast failed with an error of its own after its vote (a segment it could not reserve):
    the next send_background raises it as a failed broadcast (counted, the group dropped), not as an error of
    the version being staged, which the learner would send through the broker with the group kept."""
    from concurrent.futures import Future

    from services.learner.publish import VersionNotSent
    from services.weight_transport.collective import CollectivePublisher

    publisher = object.__new__(CollectivePublisher)
    pending: Future[Any] = Future()
    pending.set_exception(OSError(28, "No space left on device"))
    publisher._pending = pending
    with pytest.raises(TransferFailed, match="No space left on device") as raised:
        publisher.wait()
    assert not isinstance(raised.value, VersionNotSent)


def _settling(
    registry: GroupRegistry, settle_s: float, settle_max_s: float = 30.0, form_timeout_s: float = 3
) -> tuple[GroupCoordinator, list[tuple[float, str]]]:
    """A coordinator that forms once the members have settled, and the times of its events."""
    events: list[tuple[float, str]] = []
    coordinator = GroupCoordinator(
        registry,
        "127.0.0.1",
        "gloo",
        timeout_s=20,
        form_timeout_s=form_timeout_s,
        bucket_bytes=8192,
        on_event=lambda event: events.append((time.monotonic(), event)),
        settle_s=settle_s,
        settle_max_s=settle_max_s,
    )
    return coordinator, events


def _polling(
    coordinator: GroupCoordinator, seconds: float, until: Callable[[], bool] = lambda: False
) -> None:
    """Ask the coordinator as the learner does between steps, every 50 ms, for ``seconds`` or until ``until``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not until():
        coordinator.publisher()
        time.sleep(0.05)


@pytest.mark.slow
def test_members_registering_in_a_burst_form_one_epoch_not_one_each(registry: GroupRegistry) -> None:
    """Samplers register one after another at start-up, each as its engine has loaded version 0: the
    coordinator forms once, with all of them, after the last registration has settled; not an epoch per
    registration, each dropping the one before and holding the members already in it in a new join."""
    coordinator, events = _settling(registry, settle_s=1.5)
    receivers = [Receiver(registry, f"sampler-{i}.{name}") for i, name in enumerate("abc")]
    with _stopping(coordinator, *receivers):
        for r in receivers:  # 0.4 s apart, the coordinator asked every 50 ms throughout
            r.start()
            _polling(coordinator, 5, lambda r=r: r.seat.member.id in registry.live())
            _polling(coordinator, 0.4)
        _polling(coordinator, 20, lambda: coordinator.members != frozenset())
        _polling(coordinator, 2.0)  # and nothing forms again while they stay as they are
        assert coordinator.members == {r.seat.member.id for r in receivers}
        assert [event for _, event in events] == ["formed"]
        assert coordinator._made == coordinator.epoch  # one epoch taken: the one formed
        _publish(coordinator, 4)
        _until("version 4 everywhere", lambda: all(r.versions() == [4] for r in receivers))


def test_a_member_registering_after_the_group_formed_is_taken_in_once_the_members_settled(
    registry: GroupRegistry,
) -> None:
    """One more sampler after the group formed (a replica restarted, a late engine): the epoch in place goes
    on carrying versions to its members until the new one has been registered ``settle_s``, then one new
    epoch forms with it."""
    settle_s = 1.5
    coordinator, events = _settling(registry, settle_s=settle_s)
    a, d = Receiver(registry, "sampler-0.a"), Receiver(registry, "sampler-3.d")
    with _stopping(coordinator, a, d):
        a.start()
        _polling(coordinator, 20, lambda: coordinator.members == {a.seat.member.id})
        first = coordinator.epoch
        joined_at = time.monotonic()
        d.start()
        _polling(coordinator, 5, lambda: d.seat.member.id in registry.live())
        # registered, not yet settled: the epoch in place stays, and still carries versions to its members
        assert coordinator.publisher() is not None and coordinator.epoch == first
        _publish(coordinator, 1)
        _until("version 1 at a", lambda: a.versions() == [1])
        _polling(coordinator, 20, lambda: coordinator.epoch != first)
        formed = [t for t, event in events if event == "formed"]
        assert [event for _, event in events] == ["formed", "formed"]
        assert formed[1] - joined_at >= settle_s, formed[1] - joined_at
        assert coordinator.members == {a.seat.member.id, d.seat.member.id}
        _publish(coordinator, 2)
        _until("version 2 at both", lambda: a.versions() == [1, 2] and d.versions() == [2])


def test_members_that_never_stop_changing_still_form_after_the_settle_bound(registry: GroupRegistry) -> None:
    """A new member every 0.5 s never leaves the members settled for ``settle_s`` (1 s): the coordinator forms
    ``settle_max_s`` after they first differed from the group's, not later, and not earlier."""
    settle_max_s = 2.5
    coordinator, _ = _settling(registry, settle_s=1.0, settle_max_s=settle_max_s, form_timeout_s=1)
    members: list[Member] = []
    with _stopping(coordinator):
        t0 = time.monotonic()
        started = None
        while started is None and time.monotonic() < t0 + settle_max_s + 5:
            if len(members) <= (time.monotonic() - t0) / 0.5:
                members.append(Member(f"sampler-{len(members)}.churn"))
            for m in members:  # registered, and kept alive (they never arrive: this forming fails, after 1 s)
                registry.heartbeat(m)
            coordinator.publisher()
            if coordinator._forming is not None:
                started = time.monotonic()
            time.sleep(0.05)
        assert started is not None, "no forming started"
        assert settle_max_s <= started - t0 <= settle_max_s + 1.5, started - t0
        assert len(members) >= 5  # still changing when it started
        _until("the forming to end", lambda: coordinator._forming is None or coordinator._forming.done())


def test_the_settle_settings_reach_the_learners_coordinator_and_bad_ones_name_their_keys(
    registry: GroupRegistry, redis_client: redis.Redis, redis_url: str
) -> None:
    from pydantic import ValidationError

    from services.weight_transport.config import WeightBrokerConfig
    from services.weight_transport.group_control import coordinator_from_config

    wb = WeightBrokerConfig(group_settle_s=2.0, group_settle_max_s=20.0)
    c = coordinator_from_config(wb, redis_url, "wg-settle", redis_client, torch.device("cpu"))
    assert (c.settle_s, c.settle_max_s) == (2.0, 20.0)
    c.close()
    default = WeightBrokerConfig()
    assert 0 < default.group_settle_s <= default.group_settle_max_s
    with pytest.raises(ValidationError, match=r"group_settle_max_s = 1 is less than.*group_settle_s = 2"):
        WeightBrokerConfig(group_settle_s=2.0, group_settle_max_s=1.0)
    with pytest.raises(ValueError, match=r"weight_broker\.group_settle_s, weight_broker\.group_settle_max_s"):
        GroupCoordinator(registry, "127.0.0.1", settle_s=-1.0)
