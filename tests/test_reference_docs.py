"""The generated reference pages (docs/reference/, scripts/gen_reference.py) are up to date, and what the
generator reads is read right: ``# --`` comments of a values file, a model tree's tables, a proto file's
services and comments, the metrics' real collectors.

The freshness checks compare the pages with what the generator makes now, in memory; nothing is launched.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import typing
from pathlib import Path
from types import ModuleType
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, Field

ROOT = Path(__file__).parent.parent
FIX = "make reference"


def _script(name: str) -> ModuleType:
    if str(ROOT / "scripts") not in sys.path:  # the generator's modules import each other as a script's do
        sys.path.insert(0, str(ROOT / "scripts"))
    return importlib.import_module(name)


gen = _script("gen_reference")
md = _script("reference_markdown")


# ------------------------------------------------------------------------------------ the pages are fresh


def test_every_reference_page_is_up_to_date() -> None:
    stale = [str(p.relative_to(ROOT)) for p in gen.stale(gen.pages())]
    assert not stale, f"stale reference pages {stale}: run `{FIX}` ({md.COMMAND})"


def test_every_helm_value_has_a_comment() -> None:
    missing = _script("reference_helm").undocumented()
    assert not missing, f"helm/vcpo-rl/values.yaml values without a `# --` comment: {missing}"


def test_every_run_file_key_has_a_description() -> None:
    from deploy.config import SystemConfig

    missing = _script("reference_config").undocumented(SystemConfig)
    assert not missing, f"run-file keys whose Field has no description: {missing}"


def test_check_mode_names_stale_pages_and_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(gen, "OUT", tmp_path / "reference")
    assert gen.main(["--check"]) == 1
    err = capsys.readouterr().err
    for name in gen.GENERATORS:
        assert f"reference/{name} is missing" in err
    assert FIX in err and md.COMMAND in err
    assert gen.main([]) == 0 and sorted(p.name for p in (tmp_path / "reference").iterdir()) == sorted(
        gen.GENERATORS
    )
    page = tmp_path / "reference" / "metrics.md"
    assert gen.main(["--check"]) == 0
    page.write_text(page.read_text().replace("vcpo_learner_ess", "vcpo_learner_e55"))
    assert gen.main(["--check"]) == 1
    assert "reference/metrics.md is stale" in capsys.readouterr().err


def test_the_generator_runs_as_a_script() -> None:
    done = subprocess.run(
        [sys.executable, "scripts/gen_reference.py", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0 and "--check" in done.stdout, done.stderr


# ---------------------------------------------------------------------------------------------- Markdown


def test_cells_escape_pipes_and_html_like_text_outside_code() -> None:
    assert md.cell("a | b\n c") == "a \\| b c"
    assert md.prose("<runId> and `<kept>`") == "&lt;runId> and `<kept>`"
    assert md.code("a`b") == "``a`b``"
    assert md.slug("`[[sampler.environments]]`") == "samplerenvironments"
    assert md.first_paragraph("Uses ``x`` and :meth:`~a.B.c`.\n\nNot this.") == "Uses `x` and `a.B.c`."


# -------------------------------------------------------------------------------------------- Helm values

VALUES = """\
# A header comment (not documentation).

# -- Documented, on
# two lines.
top: 1
block:
  # -- (int) With a type of its own.
  size: "20"
  undocumented: x
# -- A documented map: what is under it needs no comment.
resources:
  requests: {cpu: "1"}
  # -- But one with a comment gets a row.
  limits: {cpu: "2"}
# A plain comment does not document.
bare: []
"""


def test_helm_values_follow_helm_docs_comments(tmp_path: Path) -> None:
    helm = _script("reference_helm")
    path = tmp_path / "values.yaml"
    path.write_text(VALUES)
    rows = {v.path: v for v in helm.values(path)}
    assert rows["top"].description == "Documented, on two lines." and rows["top"].type == "int"
    assert rows["block.size"].type == "int" and rows["block.size"].description == "With a type of its own."
    assert rows["resources"].default == '`{"requests": {"cpu": "1"}, "limits": {"cpu": "2"}}`'
    assert "resources.requests" not in rows and rows["resources.limits"].description
    assert helm.undocumented(path) == ["block.undocumented", "bare"]


# ------------------------------------------------------------------------------------------ config models


class _Leaf(BaseModel):
    name: str = Field(description="Its name.")


class _Section(BaseModel):
    """A section.

    More than the first paragraph."""

    mode: Literal["a", "b"] = Field("a", description="A | choice.")
    share: float = Field(0.5, gt=0, le=1, description="A bound.")
    weights: dict[str, Annotated[float, Field(gt=0)]] = Field(default_factory=dict, description="Map.")
    leaves: list[_Leaf] = Field(default_factory=list, description="Leaves.")
    by_name: dict[str, _Leaf] = Field(default_factory=dict, description="Named.")
    nested: _Leaf = Field(default_factory=lambda: _Leaf(name="n"), description="Nested.")
    bare: int = 3


class _Root(BaseModel):
    one: _Section = Field(default_factory=_Section)


def test_config_tables_walk_nested_models_lists_and_maps() -> None:
    cfg = _script("reference_config")
    tables = {t.header: t for t in cfg.tables(_Root)}
    assert list(tables) == ["[one]", "[[one.leaves]]", "[one.by_name.<name>]", "[one.nested]"]
    rows = {r[0]: r for r in tables["[one]"].rows}
    assert rows["`mode`"][1:4] == ["string", '`"a"`', 'one of `"a"`, `"b"`']
    assert rows["`share`"][3] == "> 0; ≤ 1"
    assert rows["`weights`"][1:4] == ["table of float", "`{}`", "each value > 0"]
    assert "[[one.leaves]]" in rows["`leaves`"][4] and rows["`leaves`"][1] == "array of tables"
    assert cfg.undocumented(_Root) == ["[one] bare"]
    assert typing.get_origin(_Section.model_fields["weights"].annotation) is dict


# ---------------------------------------------------------------------------------------------- the protos

PROTO = """\
// What the file is for.
syntax = "proto3";

package demo.v1;

// ---------------------------------------------------------------- public API
// Stable.

// Asks.
message Ask {
  string text = 1;                 // what is asked
  map<string, float> scores = 2;
  oneof pick {
    uint32 index = 3;
    string key = 4;
  }
  optional uint64 version = 5;     // unset: the latest
  repeated Answer.Kind kinds = 6;
}

message Answer {
  enum Kind {
    KIND_UNSPECIFIED = 0;
    SHORT = 1;  // a word
  }
}

// Answers questions.
service Oracle {
  rpc Consult(stream Ask) returns (stream Answer);  // both ways streamed
}
"""


def test_grpc_page_reads_protoc_descriptors_with_comments(tmp_path: Path) -> None:
    grpc_page = _script("reference_grpc")
    (tmp_path / "demo" / "v1").mkdir(parents=True)
    (tmp_path / "demo" / "v1" / "oracle.proto").write_text(PROTO)
    text = grpc_page.render(tmp_path)
    assert "What the file is for." in text and "> **public API.** Stable." in text
    assert "| `text` | 1 | `string` | what is asked |" in text
    assert "| `scores` | 2 | map<`string`, `float`> |  |" in text
    assert "| `index` | 3 | `uint32` | One of `pick`. |" in text
    assert "| `version` | 5 | optional `uint64` | unset: the latest |" in text
    assert "repeated [`Answer.Kind`](#enum-answerkind)" in text
    assert "| `SHORT` | 1 | a word |" in text
    assert (
        "| `Consult` | stream [`Ask`](#message-ask) | stream [`Answer`](#message-answer) | both ways streamed |"
        in text
    )
    assert "ScoresEntry" not in text  # a map's entry type is shown as map<K, V>, not as a message
    headings = {md.slug(line.lstrip("#").strip()) for line in text.splitlines() if line.startswith("#")}
    assert {"message-ask", "enum-answerkind", "service-oracle", "oracleproto"} <= headings


# ---------------------------------------------------------------------------------------------- metrics


def test_metrics_come_from_the_services_collectors() -> None:
    metrics = _script("reference_metrics")
    docs = {d.name: d for d in metrics.metric_docs()}
    assert docs["vcpo_learner_groups_dropped_total"].type == "counter"  # the family is named without _total
    assert docs["vcpo_learner_groups_dropped_total"].labels == ("cause",)
    assert docs["vcpo_stream_length"].labels == ("stream",)  # a custom collector's family
    assert docs["vcpo_learner_ess"].help.startswith("Effective sample size")  # from GAUGES, not a literal
    assert docs["vcpo_service_restarts_total"].owner == "Launcher"
    names, histograms = metrics.registered_metrics()
    assert "vcpo_sampler_group_lag" in histograms and "vcpo_collective" not in names
    assert metrics.unlisted() == []
