"""docs/reference/grpc.md: every service, rpc, message and enum of protos/vcpo/v1/*.proto with its comments.

protoc parses the files (grpc_tools' bundled protoc, as scripts/gen_protos.py uses) into a FileDescriptorSet
with source info, so comments are read from the compiler's own record of what each one is attached to
(leading and trailing comments, and the detached ones that head a part of a file), not guessed from the text.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import descriptor_pb2 as pb
from reference_markdown import banner, code, prose, slug, table

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"

# field numbers in descriptor.proto, the steps of a SourceCodeInfo.Location path
FILE_MESSAGE, FILE_ENUM, FILE_SERVICE, FILE_SYNTAX = 4, 5, 6, 12
MESSAGE_FIELD, MESSAGE_NESTED, MESSAGE_ENUM = 2, 3, 4
ENUM_VALUE, SERVICE_METHOD = 2, 2

SCALARS = {
    value: name.removeprefix("TYPE_").lower()
    for name, value in pb.FieldDescriptorProto.Type.items()
    if name not in ("TYPE_MESSAGE", "TYPE_ENUM", "TYPE_GROUP")
}


def descriptor_set(root: Path = PROTO_ROOT) -> pb.FileDescriptorSet:
    """protoc's parse of every .proto under ``root``, with source info (comments and spans)."""
    import grpc_tools
    from grpc_tools import protoc

    files = sorted(str(p.relative_to(root)) for p in root.rglob("*.proto"))
    if not files:
        raise SystemExit(f"no .proto files under {root}")
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        args = [
            "protoc",
            f"-I{root}",
            f"-I{well_known}",
            "--include_source_info",
            f"--descriptor_set_out={out}",
        ]
        if protoc.main([*args, *files]) != 0:
            raise SystemExit("protoc failed on protos/ (see the messages above)")
        return pb.FileDescriptorSet.FromString(out.read_bytes())


RULE = re.compile(r"^\s*[-=]{3,}\s*(.*?)\s*[-=]*\s*$")


def _text(comment: str) -> str:
    """A comment on one line, made safe for Markdown; a rule line (`// ---- public API`) becomes its title
    in bold."""
    lines = []
    for line in comment.splitlines():
        rule = RULE.match(line)
        if rule is None:
            lines.append(line)
        elif rule.group(1):
            lines.append(f"**{rule.group(1)}.**")
    return prose(" ".join(" ".join(lines).split()))


class Comments:
    def __init__(self, file: pb.FileDescriptorProto) -> None:
        self.at = {tuple(loc.path): loc for loc in file.source_code_info.location}

    def of(self, path: tuple[int, ...]) -> str:
        loc = self.at.get(path)
        if loc is None:
            return ""
        return _text(" ".join(c for c in (loc.leading_comments, loc.trailing_comments) if c))

    def detached(self, path: tuple[int, ...]) -> str:
        loc = self.at.get(path)
        return " ".join(_text(c) for c in loc.leading_detached_comments) if loc is not None else ""

    def line(self, path: tuple[int, ...]) -> int:
        loc = self.at.get(path)
        return loc.span[0] if loc is not None and loc.span else 0


@dataclass
class Item:
    kind: str  # service, message, enum
    name: str  # within the package: Outer.Inner
    path: tuple[int, ...]
    proto: pb.ServiceDescriptorProto | pb.DescriptorProto | pb.EnumDescriptorProto

    @property
    def heading(self) -> str:
        return f"{self.kind} {self.name}"


def _messages(
    messages: list[pb.DescriptorProto], prefix: str, path: tuple[int, ...], step: int
) -> Iterator[Item]:
    for i, m in enumerate(messages):
        if m.options.map_entry:
            continue  # shown as map<K, V> on its field
        here = (*path, step, i)
        yield Item("message", prefix + m.name, here, m)
        yield from _messages(list(m.nested_type), f"{prefix}{m.name}.", here, MESSAGE_NESTED)
        for j, e in enumerate(m.enum_type):
            yield Item("enum", f"{prefix}{m.name}.{e.name}", (*here, MESSAGE_ENUM, j), e)


def items(file: pb.FileDescriptorProto) -> list[Item]:
    """A file's services, messages and enums in the order the file declares them."""
    comments = Comments(file)
    out = [Item("service", s.name, (FILE_SERVICE, i), s) for i, s in enumerate(file.service)]
    out += list(_messages(list(file.message_type), "", (), FILE_MESSAGE))
    out += [Item("enum", e.name, (FILE_ENUM, i), e) for i, e in enumerate(file.enum_type)]
    return sorted(out, key=lambda it: (comments.line(it.path), it.path))


class Page:
    """Links between the messages of the page: a type of the package links to its heading."""

    def __init__(self, files: list[pb.FileDescriptorProto]) -> None:
        self.anchors: dict[str, tuple[str, str]] = {}  # full name -> (anchor, name within its package)
        seen: set[str] = set()
        for f in files:
            headings = [code(Path(f.name).name), *(it.heading for it in items(f))]
            for it, heading in zip([None, *items(f)], headings, strict=True):
                anchor = slug(heading)
                if anchor in seen:
                    raise SystemExit(f"two headings of docs/reference/grpc.md share the anchor #{anchor}")
                seen.add(anchor)
                if it is not None:
                    self.anchors[f".{f.package}.{it.name}"] = (anchor, it.name)

    def type_ref(self, full_name: str) -> str:
        if full_name not in self.anchors:  # another package's type (google.protobuf.*)
            return code(full_name.lstrip("."))
        anchor, shown = self.anchors[full_name]
        return f"[{code(shown)}](#{anchor})"

    def field_type(self, field: pb.FieldDescriptorProto, entries: dict[str, pb.DescriptorProto]) -> str:
        entry = entries.get(field.type_name)
        if entry is not None:  # a map field: repeated XEntry {key, value}
            key, value = entry.field
            return f"map<{self.field_type(key, {})}, {self.field_type(value, {})}>"
        base = code(SCALARS[field.type]) if field.type in SCALARS else self.type_ref(field.type_name)
        if field.label == pb.FieldDescriptorProto.LABEL_REPEATED:
            return f"repeated {base}"
        return f"optional {base}" if field.proto3_optional else base


def _map_entries(file: pb.FileDescriptorProto) -> dict[str, pb.DescriptorProto]:
    out: dict[str, pb.DescriptorProto] = {}

    def walk(messages: list[pb.DescriptorProto], prefix: str) -> None:
        for m in messages:
            if m.options.map_entry:
                out[f"{prefix}.{m.name}"] = m
            walk(list(m.nested_type), f"{prefix}.{m.name}")

    walk(list(file.message_type), f".{file.package}")
    return out


def _render_item(page: Page, item: Item, comments: Comments, entries: dict[str, pb.DescriptorProto]) -> str:
    parts = []
    note = comments.detached(item.path)
    if note:
        parts.append(f"> {note}\n")
    parts.append(f"### {item.heading}\n")
    about = comments.of(item.path)
    if about:
        parts.append(about + "\n")
    proto = item.proto
    if isinstance(proto, pb.ServiceDescriptorProto):
        rows = []
        for i, m in enumerate(proto.method):
            request = ("stream " if m.client_streaming else "") + page.type_ref(m.input_type)
            response = ("stream " if m.server_streaming else "") + page.type_ref(m.output_type)
            rows.append([code(m.name), request, response, comments.of((*item.path, SERVICE_METHOD, i))])
        parts.append(table(["RPC", "Request", "Response", "Description"], rows))
    elif isinstance(proto, pb.DescriptorProto):
        rows = []
        for i, f in enumerate(proto.field):
            about = comments.of((*item.path, MESSAGE_FIELD, i))
            if f.HasField("oneof_index") and not f.proto3_optional:
                about = f"One of {code(proto.oneof_decl[f.oneof_index].name)}. {about}".strip()
            rows.append([code(f.name), str(f.number), page.field_type(f, entries), about])
        if rows:
            parts.append(table(["Field", "Number", "Type", "Description"], rows))
        else:
            parts.append("No fields.\n")
    else:
        rows = [
            [code(v.name), str(v.number), comments.of((*item.path, ENUM_VALUE, i))]
            for i, v in enumerate(proto.value)
        ]
        parts.append(table(["Value", "Number", "Description"], rows))
    return "\n".join(parts)


def render(root: Path = PROTO_ROOT) -> str:
    files = sorted(descriptor_set(root).file, key=lambda f: f.name)
    page = Page(files)
    packages = sorted({f.package for f in files})
    parts = [
        "# gRPC API reference\n",
        banner("protos/vcpo/v1/*.proto (protoc's descriptors with their comments)"),
        f"Package {', '.join(code(p) for p in packages)}: every service, rpc, message and enum of the "
        "`.proto` files under `protos/`, file by file in declaration order, with the comments the files "
        "carry. A quoted note above a heading is the comment that heads that part of its file (for example "
        "where the public API ends and the internal stream payloads begin). Python code is generated from "
        "the same files into `gen/` by `make proto`.\n",
    ]
    index = []
    for f in files:
        services = [it for it in items(f) if it.kind == "service"]
        listed = ", ".join(f"[{code(s.name)}](#{slug(s.heading)})" for s in services) or "messages only"
        index.append(f"- [{code(Path(f.name).name)}](#{slug(code(Path(f.name).name))}): {listed}")
    parts.append("\n".join(index) + "\n")
    for f in files:
        comments = Comments(f)
        parts.append(f"## {code(Path(f.name).name)}\n")
        about = comments.of((FILE_SYNTAX,)) or comments.detached((FILE_SYNTAX,))
        source = f"Source: `{PROTO_ROOT.relative_to(ROOT)}/{f.name}`."
        parts.append(f"{about} {source}\n" if about else f"{source}\n")
        entries = _map_entries(f)
        parts += [_render_item(page, it, comments, entries) for it in items(f)]
    return "\n".join(parts)
