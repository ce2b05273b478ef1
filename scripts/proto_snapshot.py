"""The wire contract of vcpo.v1, recorded in tests/data/proto_api.json and checked against protos/.

    python scripts/proto_snapshot.py            # record what was added (refuses a breaking change)
    python scripts/proto_snapshot.py --check    # exit 1 naming each break, or an addition not yet recorded

Each .proto file is divided by marker lines into a public API section and an internal one (see
docs/environments/versioning.md for the policy they stand for):

    // ---...--- public API      messages, enums and services a client or an environment server uses
    // ---...--- internal        payloads between the system's own services

What is checked, from the descriptors protoc makes of protos/ (the snapshot holds every message's fields by
number, every enum's values and every service's rpcs):

- a public message, enum value, service or rpc stays, and a public field keeps its number, name, type, label
  and oneof: fields, messages and rpcs are only added;
- a field or enum value removed from an internal message leaves its number and name ``reserved``, and a
  number never comes back with another type (a stream entry written before a release is read after it);
- nothing a public rpc carries is internal: every message reachable from a public service is in a public
  section;
- every file names the same ``go_package``, ``java_package``, ``csharp_namespace`` and its own
  ``java_outer_classname`` (Java would otherwise write ``Reward.java`` twice: reward.proto's outer class and
  rollout.proto's message).

``buf breaking`` makes the first checks too, but buf is a separate Go binary that neither ``make setup`` nor
CI installs; protoc's descriptors (grpc_tools, already a dependency) carry all this needs.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
SNAPSHOT = ROOT / "tests" / "data" / "proto_api.json"
PACKAGE = "vcpo.v1"
MARKER = re.compile(r"^// -{10,} (public API|internal)\s*$")
TOP_LEVEL = re.compile(r"^(message|enum|service) (\w+)")
SHARED_OPTIONS: tuple[
    Literal["go_package", "java_package", "java_multiple_files", "csharp_namespace"], ...
] = (
    "go_package",
    "java_package",
    "java_multiple_files",
    "csharp_namespace",
)
UPDATE = "python scripts/proto_snapshot.py"

_FDP = descriptor_pb2.FieldDescriptorProto
_TYPES = {v: k.removeprefix("TYPE_").lower() for k, v in _FDP.Type.items()}
_LABELS = {_FDP.LABEL_OPTIONAL: "", _FDP.LABEL_REPEATED: "repeated ", _FDP.LABEL_REQUIRED: "required "}
_NAMED = re.compile(r"^(.*) (\w+)( \(oneof \w+\))?$")  # a field's text: "<type> <name>[ (oneof <o>)]"


@dataclass
class Api:
    """What the snapshot records: ``messages`` and ``enums`` as {full name: {"public", numbers -> text, and
    "reserved" {"ranges", "names"} when there are any}}, ``services`` as {full name: {"public", rpc name ->
    signature}}; ``problems`` (found while reading) are checked, not recorded."""

    messages: dict[str, dict[str, Any]] = field(default_factory=dict)
    enums: dict[str, dict[str, Any]] = field(default_factory=dict)
    services: dict[str, dict[str, Any]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def recorded(self) -> dict[str, Any]:
        return {"messages": self.messages, "enums": self.enums, "services": self.services}


def compile_protos(proto_root: Path) -> descriptor_pb2.FileDescriptorSet:
    import grpc_tools
    from grpc_tools import protoc

    files = sorted(str(p.relative_to(proto_root)) for p in proto_root.rglob("*.proto"))
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        args = ["protoc", f"-I{proto_root}", f"-I{well_known}", f"--descriptor_set_out={out}", *files]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc could not compile {proto_root} (see the messages above)")
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def sections(text: str, where: str) -> tuple[dict[str, bool], list[str]]:
    """{top-level message, enum or service name: public?} from a file's marker lines, and what is amiss."""
    public: bool | None = None
    out: dict[str, bool] = {}
    problems = []
    for number, line in enumerate(text.splitlines(), 1):
        if marker := MARKER.match(line):
            public = marker.group(1) == "public API"
        elif top := TOP_LEVEL.match(line):
            if public is None:
                problems.append(
                    f"{where}:{number}: {top.group(2)} comes before any '// ---- public API' or "
                    "'// ---- internal' marker line; put it in one of the two sections"
                )
            out[top.group(2)] = bool(public)
    return out, problems


def _field_text(f: descriptor_pb2.FieldDescriptorProto, message: descriptor_pb2.DescriptorProto) -> str:
    kind = f.type_name.lstrip(".") if f.type_name else _TYPES[f.type]
    entry = next((n for n in message.nested_type if f.type_name.endswith(f".{n.name}")), None)
    if entry is not None and entry.options.map_entry:
        key, value = entry.field
        return f"map<{_TYPES[key.type]}, {value.type_name.lstrip('.') or _TYPES[value.type]}> {f.name}"
    text = f"{_LABELS[f.label]}{kind} {f.name}"
    if f.proto3_optional:
        return f"optional {text}"
    if f.HasField("oneof_index"):
        return f"{text} (oneof {message.oneof_decl[f.oneof_index].name})"
    return text


def _add_message(api: Api, message: descriptor_pb2.DescriptorProto, scope: str, public: bool) -> None:
    name = f"{scope}.{message.name}"
    if message.options.map_entry:
        return  # a map field's entry: recorded as the field's map<K, V> type
    api.messages[name] = {
        "public": public,
        "fields": {str(f.number): _field_text(f, message) for f in message.field},
    }
    ranges = [[r.start, r.end - 1] for r in message.reserved_range]  # recorded inclusive, as enums write them
    if ranges or message.reserved_name:
        api.messages[name]["reserved"] = {"ranges": ranges, "names": sorted(message.reserved_name)}
    for nested in message.nested_type:
        _add_message(api, nested, name, public)
    for enum in message.enum_type:
        _add_enum(api, enum, name, public)


def _add_enum(api: Api, enum: descriptor_pb2.EnumDescriptorProto, scope: str, public: bool) -> None:
    name = f"{scope}.{enum.name}"
    api.enums[name] = {"public": public, "values": {str(v.number): v.name for v in enum.value}}
    ranges = [[r.start, r.end] for r in enum.reserved_range]  # an enum's reserved ranges are inclusive
    if ranges or enum.reserved_name:
        api.enums[name]["reserved"] = {"ranges": ranges, "names": sorted(enum.reserved_name)}


def describe(proto_root: Path | None = None) -> Api:
    """The vcpo.v1 files under ``proto_root`` (default: protos/) as the snapshot records them."""
    proto_root = proto_root or PROTO_ROOT
    api = Api()
    files = [f for f in compile_protos(proto_root).file if f.package == PACKAGE]
    outer: dict[str, str] = {}
    for f in files:
        public, problems = sections((proto_root / f.name).read_text(), f.name)
        api.problems += problems
        scope = f.package
        for message in f.message_type:
            _add_message(api, message, scope, public.get(message.name, False))
        for enum in f.enum_type:
            _add_enum(api, enum, scope, public.get(enum.name, False))
        for service in f.service:
            api.services[f"{scope}.{service.name}"] = {
                "public": public.get(service.name, False),
                "rpcs": {
                    m.name: f"{'stream ' * m.client_streaming}{m.input_type.lstrip('.')} -> "
                    f"{'stream ' * m.server_streaming}{m.output_type.lstrip('.')}"
                    for m in service.method
                },
            }
        if f.options.java_outer_classname in outer:
            api.problems.append(
                f"{f.name}: java_outer_classname {f.options.java_outer_classname!r} is also "
                f"{outer[f.options.java_outer_classname]}'s; give each file its own (<File>Proto)"
            )
        elif not f.options.java_outer_classname:
            api.problems.append(f"{f.name}: no option java_outer_classname (<File>Proto, e.g. RolloutProto)")
        outer[f.options.java_outer_classname] = f.name
    for option in SHARED_OPTIONS:
        values = {f.name: getattr(f.options, option) if f.options.HasField(option) else None for f in files}
        if None in values.values() or len(set(values.values())) != 1:
            api.problems.append(f"option {option} must be set alike in every vcpo.v1 file: {values}")
    api.problems += _internal_leaks(api)
    return api


def _internal_leaks(api: Api) -> list[str]:
    """Messages or enums a public rpc carries (directly or through fields) that sit in an internal section."""
    used = re.compile(r"(?<![\w.])(vcpo\.v1(?:\.\w+)+)")
    seen: set[str] = set()
    todo = [
        (t, f"{name}.{rpc}")
        for name, service in api.services.items()
        if service["public"]
        for rpc, signature in service["rpcs"].items()
        for t in used.findall(signature)
    ]
    problems = []
    while todo:
        type_name, via = todo.pop()
        if type_name in seen:
            continue
        seen.add(type_name)
        kind = api.messages.get(type_name) or api.enums.get(type_name)
        if kind is None:
            continue
        if not kind["public"]:
            problems.append(
                f"{type_name} is in an internal section but a public rpc carries it (through {via}); "
                "move it to the public API section, or keep it out of the public messages"
            )
            continue  # what it holds in turn is named once it is public
        for text in kind.get("fields", {}).values():
            todo += [(t, f"{type_name}") for t in used.findall(text)]
    return problems


def _name(text: str) -> str:
    """A field's or enum value's name, from its recorded text."""
    match = _NAMED.match(text)
    return match.group(2) if match else text


def _unnamed(text: str) -> str:
    """A field's recorded text without its name: what an internal field's number keeps."""
    match = _NAMED.match(text)
    return f"{match.group(1)}{match.group(3) or ''}" if match else ""


def _reserved(entry: dict[str, Any], number: str, text: str) -> bool:
    """Whether a message's or enum's recorded entry reserves this field number and the field's name."""
    reserved = entry.get("reserved", {"ranges": [], "names": []})
    in_range = any(start <= int(number) <= end for start, end in reserved["ranges"])
    return in_range and _name(text) in reserved["names"]


def breaks(old: dict[str, Any], new: Api) -> list[str]:
    """What ``new`` breaks of the recorded contract ``old`` (empty: compatible)."""
    out = []
    for kind, items, member in (("message", new.messages, "fields"), ("enum", new.enums, "values")):
        for name, was in old[f"{kind}s"].items():
            now = items.get(name)
            if now is None:
                if was["public"]:
                    out.append(f"public {kind} {name} was removed")
                continue
            if was["public"] and not now["public"]:
                out.append(f"public {kind} {name} moved to an internal section")
            kept = now.get("reserved", {"ranges": [], "names": []})
            for key in ("ranges", "names"):
                dropped = [r for r in was.get("reserved", {}).get(key, []) if r not in kept[key]]
                if dropped:
                    out.append(f"{kind} {name} no longer reserves {dropped}: a reserved {key[:-1]} stays so")
            for number, text in was[member].items():
                current = now[member].get(number)
                label = f"{name} {member[:-1]} {number} ({text})"
                if current == text:
                    continue
                if current is None and was["public"]:
                    out.append(f"{label} was removed from the public API (deprecate it instead)")
                elif current is None and not _reserved(now, number, text):
                    out.append(f"{label} was removed without `reserved {number};` and its name reserved")
                elif current is not None and was["public"]:
                    out.append(f"{label} is now {current!r}: a public field keeps its number, name and type")
                elif current is not None and _unnamed(text) != _unnamed(current):
                    out.append(f"{label} is now {current!r}: a number never comes back with another type")
    for name, was in old["services"].items():
        now = new.services.get(name)
        if not was["public"]:
            continue
        if now is None or not now["public"]:
            out.append(f"public service {name} was removed or made internal")
            continue
        for rpc, signature in was["rpcs"].items():
            if now["rpcs"].get(rpc) != signature:
                out.append(f"rpc {name}.{rpc} ({signature}) was removed or changed: add a new rpc instead")
    return out


def additions(old: dict[str, Any], new: Api) -> list[str]:
    """What ``new`` has that ``old`` does not record (fine, but the snapshot must learn it)."""
    out = []
    for section, member in (("messages", "fields"), ("enums", "values"), ("services", "rpcs")):
        for name, now in getattr(new, section).items():
            was = old[section].get(name)
            if was is None:
                out.append(f"{section[:-1]} {name}")
                continue
            out += [f"{name} {k}" for k in now[member] if k not in was[member]]
            if now.get("reserved") != was.get("reserved"):
                out.append(f"{name} reserved {now.get('reserved')}")
            if now["public"] and not was["public"]:
                out.append(f"{name} made public")
    return out


def load_snapshot(path: Path | None = None) -> dict[str, Any]:
    recorded: dict[str, Any] = json.loads((path or SNAPSHOT).read_text())
    return recorded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if the snapshot is stale"
    )
    args = parser.parse_args(argv)
    new = describe()
    old = load_snapshot() if SNAPSHOT.exists() else {"messages": {}, "enums": {}, "services": {}}
    shown = SNAPSHOT.relative_to(ROOT) if SNAPSHOT.is_relative_to(ROOT) else SNAPSHOT
    wrong = new.problems + breaks(old, new)
    if wrong:
        print("protos/ breaks the vcpo.v1 contract (docs/environments/versioning.md):", file=sys.stderr)
        print("\n".join(f"  {line}" for line in wrong), file=sys.stderr)
        return 1
    added = additions(old, new)
    if args.check:
        if added:
            print(f"not in {shown} yet (run `{UPDATE}`): {', '.join(added)}")
            return 1
        print(f"protos/ match {shown}")
        return 0
    SNAPSHOT.write_text(json.dumps(new.recorded(), indent=1, sort_keys=True) + "\n")
    print(f"recorded {len(added)} addition(s) in {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
