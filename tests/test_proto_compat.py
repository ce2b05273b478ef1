"""vcpo.v1 keeps its compatibility policy (docs/environments/versioning.md), by scripts/proto_snapshot.py.

The committed snapshot (tests/data/proto_api.json) matches protos/; each kind of breaking change, made to a
copy of protos/, is refused by name while additions and an internal field retired with `reserved` are not;
nothing a public rpc carries sits in an internal section; the options other languages' generators need are
set alike in every file, and protoc's Java and C# generators (when protoc is installed) accept the files.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("proto_snapshot", ROOT / "scripts" / "proto_snapshot.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["proto_snapshot"] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


snap = _load_script()


def edited(tmp_path: Path, file: str, old: str, new: str) -> Path:
    """A copy of protos/ with ``old`` replaced by ``new`` in vcpo/v1/<file>; ``old`` must be there once, and
    may hold several texts to replace, joined by " ||| " (as ``new`` their replacements)."""
    root = tmp_path / "protos"
    shutil.copytree(ROOT / "protos", root)
    path = root / "vcpo" / "v1" / file
    text = path.read_text()
    for before, after in zip(old.split(" ||| "), new.split(" ||| "), strict=True):
        assert text.count(before) == 1, f"{before!r} is not in {file} exactly once"
        text = text.replace(before, after)
    path.write_text(text)
    return root


def test_the_snapshot_is_current() -> None:
    api = snap.describe()
    recorded = snap.load_snapshot()
    assert api.problems == []
    assert snap.breaks(recorded, api) == []
    assert snap.additions(recorded, api) == [], "run `python scripts/proto_snapshot.py` to record them"
    public = {name for name, m in recorded["messages"].items() if m["public"]}
    assert {"vcpo.v1.Task", "vcpo.v1.EnvironmentSpec", "vcpo.v1.StepResponse", "vcpo.v1.Reward"} <= public
    assert not {"vcpo.v1.TrajectoryGroup", "vcpo.v1.SamplingParams", "vcpo.v1.VersionManifest"} & public


@pytest.mark.parametrize(
    ("file", "old", "new", "expected"),
    [
        pytest.param(
            "rollout.proto",
            "  string payload_json = 8;\n",
            "",
            "vcpo.v1.Task field 8 (string payload_json) was removed from the public API",
            id="public field removed",
        ),
        pytest.param(
            "rollout.proto",
            "string split = 9;",
            "string split = 10;",
            "vcpo.v1.Task field 9 (string split) was removed from the public API",
            id="public field renumbered",
        ),
        pytest.param(
            "environment.proto",
            "bool done = 3;",
            "uint32 done = 3;",
            "vcpo.v1.StepResponse field 3 (bool done) is now 'uint32 done'",
            id="public field retyped",
        ),
        pytest.param(
            "environment.proto",
            "message CloseRequest {\n  string session_id = 1;",
            "message CloseRequest {\n  string session = 1;",
            "vcpo.v1.CloseRequest field 1 (string session_id) is now 'string session'",
            id="public field renamed",
        ),
        pytest.param(
            "environment.proto",
            "repeated ToolSchema tools = 2;",
            "ToolSchema tools = 2;",
            "vcpo.v1.ResetResponse field 2 (repeated vcpo.v1.ToolSchema tools) is now 'vcpo.v1.ToolSchema tools'",
            id="public field no longer repeated",
        ),
        pytest.param(
            "registry.proto",
            "  uint32 max_concurrency = 4;",
            "  oneof limit { uint32 max_concurrency = 4; }",
            "vcpo.v1.EnvironmentSpec field 4 (uint32 max_concurrency) is now "
            "'uint32 max_concurrency (oneof limit)'",
            id="public field moved into a oneof",
        ),
        pytest.param(
            "environment.proto",
            "  rpc Close(CloseRequest) returns (CloseResponse);\n",
            "",
            "rpc vcpo.v1.Environment.Close (vcpo.v1.CloseRequest -> vcpo.v1.CloseResponse) was removed or changed",
            id="public rpc removed",
        ),
        pytest.param(
            "environment.proto",
            "rpc Step(StepRequest)",
            "rpc Step(stream StepRequest)",
            "rpc vcpo.v1.Environment.Step (vcpo.v1.StepRequest -> vcpo.v1.StepResponse) was removed or changed",
            id="public rpc made streaming",
        ),
        pytest.param(
            "common.proto",
            "    DRAINING = 4;\n",
            "",
            "vcpo.v1.ServiceStatus.State value 4 (DRAINING) was removed from the public API",
            id="public enum value removed",
        ),
        pytest.param(
            "reward.proto",
            "message ListScorersResponse {\n  repeated string scorers = 1;\n}\n ||| returns (ListScorersResponse)",
            " ||| returns (ScoreBatchResponse)",
            "public message vcpo.v1.ListScorersResponse was removed",
            id="public message removed",
        ),
        pytest.param(
            "rollout.proto",
            "  string sampler_id = 9;\n",
            "",
            "vcpo.v1.TrajectoryGroup field 9 (string sampler_id) was removed without `reserved 9;`",
            id="internal field removed without reserved",
        ),
        pytest.param(
            "rollout.proto",
            "double scored_unix = 12;",
            "string scored_unix = 12;",
            "vcpo.v1.TrajectoryGroup field 12 (double scored_unix) is now 'string scored_unix': a number never "
            "comes back with another type",
            id="internal number retyped",
        ),
    ],
)
def test_a_breaking_change_is_refused_by_name(
    tmp_path: Path, file: str, old: str, new: str, expected: str
) -> None:
    api = snap.describe(edited(tmp_path, file, old, new))
    found = snap.breaks(snap.load_snapshot(), api)
    assert any(line.startswith(expected) for line in found), found


@pytest.mark.parametrize(
    ("file", "old", "new", "added"),
    [
        pytest.param(
            "registry.proto",
            "  string auth_token = 13;",
            "  string note = 14;\n  string auth_token = 13;",
            ["vcpo.v1.EnvironmentSpec 14"],
            id="public field added",
        ),
        pytest.param(
            "environment.proto",
            "  rpc Close(CloseRequest) returns (CloseResponse);\n",
            "  rpc Close(CloseRequest) returns (CloseResponse);\n  rpc Ping(CloseRequest) returns (CloseResponse);\n",
            ["vcpo.v1.Environment Ping"],
            id="public rpc added",
        ),
        pytest.param(
            "rollout.proto",
            "  string sampler_id = 9;\n",
            '  reserved 9;\n  reserved "sampler_id";\n',
            ["vcpo.v1.TrajectoryGroup reserved {'ranges': [[9, 9]], 'names': ['sampler_id']}"],
            id="internal field retired with reserved",
        ),
        pytest.param(
            "rollout.proto",
            "string sampler_id = 9;",
            "string sampler = 9;",
            [],
            id="internal field renamed",
        ),
    ],
)
def test_an_addition_or_a_reserved_retirement_is_not_a_break(
    tmp_path: Path, file: str, old: str, new: str, added: list[str]
) -> None:
    api = snap.describe(edited(tmp_path, file, old, new))
    recorded = snap.load_snapshot()
    assert api.problems == [] and snap.breaks(recorded, api) == []
    assert snap.additions(recorded, api) == added


def test_nothing_a_public_rpc_carries_is_internal(tmp_path: Path) -> None:
    leak = edited(
        tmp_path,
        "environment.proto",
        "map<string, string> info = 4;",
        "map<string, string> info = 4;\n  TrajectoryGroup group = 5;",
    )
    problems = snap.describe(leak).problems
    assert len(problems) == 1 and problems[0].startswith(
        "vcpo.v1.TrajectoryGroup is in an internal section but a public rpc carries it (through "
        "vcpo.v1.StepResponse)"
    ), problems


def test_every_message_is_in_a_section(tmp_path: Path) -> None:
    unmarked = edited(
        tmp_path, "weights.proto", "package vcpo.v1;\n", "package vcpo.v1;\n\nmessage Early {}\n"
    )
    problems = snap.describe(unmarked).problems
    assert any(re.match(r"vcpo/v1/weights.proto:\d+: Early comes before any", p) for p in problems), problems


def test_every_file_names_the_generator_options(tmp_path: Path) -> None:
    text = (ROOT / "protos" / "vcpo" / "v1" / "reward.proto").read_text()
    go = re.search(r'^option go_package = "[^"]*";\n', text, re.M)
    assert go is not None
    problems = snap.describe(edited(tmp_path, "reward.proto", go.group(0), "")).problems
    assert [p for p in problems if p.startswith("option go_package must be set alike")], problems
    clash = edited(tmp_path / "b", "reward.proto", '"RewardProto"', '"RolloutProto"')
    assert any("java_outer_classname 'RolloutProto' is also" in p for p in snap.describe(clash).problems)


def test_the_update_command_records_additions_and_refuses_breaks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    committed = ROOT / "tests" / "data" / "proto_api.json"
    snapshot = tmp_path / "proto_api.json"
    shutil.copy(committed, snapshot)
    monkeypatch.setattr(snap, "SNAPSHOT", snapshot)
    monkeypatch.setattr(snap, "PROTO_ROOT", edited(tmp_path / "a", "environment.proto", "bool done = 3;", ""))
    assert snap.main([]) == 1  # a public field removed: nothing written
    assert "StepResponse field 3 (bool done) was removed" in capsys.readouterr().err
    assert snapshot.read_bytes() == committed.read_bytes()
    added = edited(
        tmp_path / "b", "environment.proto", "bool done = 3;", "bool done = 3;\n  string hint = 5;"
    )
    monkeypatch.setattr(snap, "PROTO_ROOT", added)
    assert snap.main(["--check"]) == 1
    assert "vcpo.v1.StepResponse 5" in capsys.readouterr().out
    assert snap.main([]) == 0
    assert (
        json.loads(snapshot.read_text())["messages"]["vcpo.v1.StepResponse"]["fields"]["5"] == "string hint"
    )
    assert snap.main(["--check"]) == 0


def test_a_reserved_number_stays_reserved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once recorded, a retired number cannot come back by dropping its `reserved` line."""
    snapshot = tmp_path / "proto_api.json"
    shutil.copy(ROOT / "tests" / "data" / "proto_api.json", snapshot)
    monkeypatch.setattr(snap, "SNAPSHOT", snapshot)
    retired = edited(
        tmp_path / "a", "rollout.proto", "  string sampler_id = 9;\n", "  reserved 9, 13 to 15;\n"
    )
    monkeypatch.setattr(snap, "PROTO_ROOT", retired)
    assert snap.main([]) == 1  # the name is not reserved
    retired = edited(
        tmp_path / "b",
        "rollout.proto",
        "  string sampler_id = 9;\n",
        '  reserved 9, 13 to 15;\n  reserved "sampler_id";\n',
    )
    monkeypatch.setattr(snap, "PROTO_ROOT", retired)
    assert snap.main([]) == 0
    assert json.loads(snapshot.read_text())["messages"]["vcpo.v1.TrajectoryGroup"]["reserved"] == {
        "ranges": [[9, 9], [13, 15]],
        "names": ["sampler_id"],
    }
    reused = edited(
        tmp_path / "c", "rollout.proto", "  string sampler_id = 9;\n", "  uint64 sampler_id = 9;\n"
    )
    found = snap.breaks(snap.load_snapshot(snapshot), snap.describe(reused))
    assert found == [
        "message vcpo.v1.TrajectoryGroup no longer reserves [[9, 9], [13, 15]]: a reserved range stays so",
        "message vcpo.v1.TrajectoryGroup no longer reserves ['sampler_id']: a reserved name stays so",
    ]


@pytest.mark.skipif(shutil.which("protoc") is None, reason="needs protoc (Debian: protobuf-compiler)")
def test_java_and_csharp_generators_accept_the_protos(tmp_path: Path) -> None:
    files = sorted(str(p.relative_to(ROOT / "protos")) for p in (ROOT / "protos").rglob("*.proto"))
    (tmp_path / "java").mkdir()
    (tmp_path / "cs").mkdir()
    done = subprocess.run(
        ["protoc", "-Iprotos", f"--java_out={tmp_path / 'java'}", f"--csharp_out={tmp_path / 'cs'}", *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    java = tmp_path / "java" / "io" / "github" / "vcpo_rl" / "vcpo" / "v1"
    assert (java / "Reward.java").is_file() and (java / "RewardProto.java").is_file()
    assert "namespace Vcpo.V1" in (tmp_path / "cs" / "Environment.cs").read_text()
