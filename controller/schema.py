"""The committed files generated from the config's one schema, and their regeneration.

``controller.config`` declares every knob once (``knob(...)``: meaning, unit, bounds,
spec name). From it come, at import time, the REST models (``controller.api``) and
the spec codec (``controller.crd.spec``); and, through this module, the files that
must be committed:

- the CRD, ``helm/sara/crds/sloautoscalers.sara.io.yaml``: its ``spec`` schema is
  generated (``controller.crd.openapi``); everything else in it (names, printer
  columns, the status schema) is written by hand in that file and kept as it is;
- the config-fields table of ``README.md`` and ``docs/api.md``;
- the spec-fields table of ``docs/operator.md``.

``python -m controller.schema --write`` rewrites them; ``--check`` (the default)
exits 1 naming each file that is out of date. The tests check the same.
"""

from __future__ import annotations

import argparse
import copy
import enum
import json
import sys
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from controller.config import ControllerConfig, KnobField, leaf_knobs
from controller.crd.openapi import spec_fields_markdown, spec_schema

ROOT = Path(__file__).resolve().parents[1]
CRD_PATH = ROOT / "helm/sara/crds/sloautoscalers.sara.io.yaml"
CRD_HEADER = """\
# The SLOAutoscaler: which prefill and decode Deployments to size, to which SLOs, and
# every knob of the controller. The spec maps 1:1 onto the controller's config
# document (docs/operator.md has the table); `sara operator` runs one control loop
# per resource and reports in its status. Defaults are the controller's own.
#
# The spec's schema is generated from controller/config.py: run
# `python -m controller.schema --write` after changing a knob. The rest of this file
# (names, printer columns, the status schema) is edited here and kept by the generator.
"""


# --------------------------------------------------------------------------------------
# The CRD
# --------------------------------------------------------------------------------------


def crd_document(current: Any) -> Any:
    """``current`` (the CRD as loaded) with its spec schema regenerated."""
    document = copy.deepcopy(current)
    (version,) = document["spec"]["versions"]
    version["schema"]["openAPIV3Schema"]["properties"]["spec"] = spec_schema()
    return document


class _Dumper(yaml.SafeDumper):
    """Block style, lists indented under their key, as kubectl users write YAML."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)


def _string(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    # Long descriptions and CEL rules fold (>-) onto lines short enough to read.
    style = ">" if len(text) > 72 and "\n" not in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _string)


def render_crd(current_text: str) -> str:
    """The CRD's text: ``current_text`` with the spec schema generated afresh."""
    document = crd_document(yaml.safe_load(current_text))
    body: str = yaml.dump(document, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=88)
    return CRD_HEADER + body


# --------------------------------------------------------------------------------------
# The config-fields table (README.md, docs/api.md)
# --------------------------------------------------------------------------------------


def config_fields_markdown() -> str:
    """The table of every config field: dotted name, type, default, range, meaning."""
    lines = [
        "| field | type | default | allowed | meaning |",
        "|---|---|---|---|---|",
    ]
    for name, item in leaf_knobs(ControllerConfig):
        meaning = item.knob.doc.replace("|", r"\|")  # a bare | would split the cell
        default = item.default.value if isinstance(item.default, enum.Enum) else item.default
        lines.append(
            f"| `{name}` | {_type_name(item)} | `{json.dumps(default)}` "
            f"| {_range(item)} | {meaning} |"
        )
    return "\n".join(lines) + "\n"


def _type_name(item: KnobField) -> str:
    kind = item.type
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return " \\| ".join(f'"{member.value}"' for member in kind)
    names = {bool: "boolean", int: "integer", float: "number", str: "string"}
    members = typing.get_args(kind) or (kind,)
    text = " \\| ".join("null" if m is type(None) else names[m] for m in members)
    return f"{text} ({item.knob.unit})" if item.knob.unit else text


def _range(item: KnobField) -> str:
    meta = item.knob
    parts = []
    if meta.lower is not None:
        parts.append(f"{'>' if meta.gt is not None else '≥'} {meta.lower:g}")
    if meta.upper is not None:
        parts.append(f"{'<' if meta.lt is not None else '≤'} {meta.upper:g}")
    if meta.min_length is not None:
        parts.append(f"length ≥ {meta.min_length}")
    return ", ".join(parts) or "—"


# --------------------------------------------------------------------------------------
# The files
# --------------------------------------------------------------------------------------


def replace_table(text: str, table: str) -> str:
    """``text`` with the Markdown table that starts with ``table``'s header replaced."""
    header = table.splitlines()[0]
    lines = text.splitlines(keepends=True)
    starts = [n for n, line in enumerate(lines) if line.rstrip("\n") == header]
    if len(starts) != 1:
        raise ValueError(f"expected one table headed {header!r}, found {len(starts)}")
    end = starts[0]
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "".join(lines[: starts[0]]) + table + "".join(lines[end:])


def generated_files() -> dict[Path, Callable[[str], str]]:
    """Each generated file and how its new text follows from its current text."""
    config_table = config_fields_markdown()
    return {
        CRD_PATH: render_crd,
        ROOT / "README.md": lambda text: replace_table(text, config_table),
        ROOT / "docs/api.md": lambda text: replace_table(text, config_table),
        ROOT / "docs/operator.md": lambda text: replace_table(text, spec_fields_markdown()),
    }


def stale_files() -> list[Path]:
    """The generated files whose committed text is not what the schema gives."""
    out = []
    for path, regenerate in generated_files().items():
        text = path.read_text(encoding="utf-8")
        if regenerate(text) != text:
            out.append(path)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m controller.schema", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--write", action="store_true", help="rewrite the generated files")
    args = parser.parse_args(argv)
    if args.write:
        for path, regenerate in generated_files().items():
            text = path.read_text(encoding="utf-8")
            path.write_text(regenerate(text), encoding="utf-8")
        return 0
    stale = stale_files()
    for path in stale:
        print(f"{path.relative_to(ROOT)}: out of date; run python -m controller.schema --write")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
