#!/usr/bin/env python3
"""Write deploy/serve_config.gpu.yaml into k8s/rayservice.yaml as its serveConfigV2.

The serve config is the one source of truth; the RayService carries a copy between two marker
comments. Only that block is rewritten, so everything else in the manifest (comments, order,
formatting) stays byte for byte as written.

    python k8s/generate.py            rewrite the block
    python k8s/generate.py --check    exit 1 and print a diff when the block is out of date

Needs nothing beyond PyYAML.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "deploy" / "serve_config.gpu.yaml"
TARGET = REPO / "k8s" / "rayservice.yaml"

BEGIN = "# >>> BEGIN GENERATED serveConfigV2"
END = "# <<< END GENERATED serveConfigV2"
BLOCK = re.compile(
    rf"^(?P<indent>[ ]*){re.escape(BEGIN)}[^\n]*\n.*?^(?P=indent){re.escape(END)}[^\n]*\n", re.MULTILINE | re.DOTALL
)


def serve_config_body(source: Path) -> str:
    """The serve config's text without its leading comment header (it talks about this very process)."""
    lines = source.read_text().splitlines()
    while lines and (not lines[0].strip() or lines[0].lstrip().startswith("#")):
        lines.pop(0)
    if any("\t" in line for line in lines):
        raise SystemExit(f"{source}: tabs cannot go into a YAML block scalar; use spaces")
    config = yaml.safe_load("\n".join(lines))
    if not isinstance(config, dict) or not config.get("applications"):
        raise SystemExit(f"{source}: not a Serve config (no applications)")
    return "\n".join(line.rstrip() for line in lines) + "\n"


def render_block(body: str, indent: str, source: Path) -> str:
    rel = source.relative_to(REPO) if source.is_relative_to(REPO) else source
    inner = indent + "  "
    content = "".join(inner + line + "\n" if line else "\n" for line in body.splitlines())
    return (
        f"{indent}{BEGIN} from {rel} by k8s/generate.py; do not edit by hand\n"
        f"{indent}serveConfigV2: |\n"
        f"{content}"
        f"{indent}{END}\n"
    )


def regenerate(manifest: str, body: str, source: Path) -> str:
    matches = list(BLOCK.finditer(manifest))
    if len(matches) != 1:
        raise SystemExit(
            f"{TARGET}: expected exactly one block between '{BEGIN}' and '{END}' "
            f"at the same indentation, found {len(matches)}"
        )
    match = matches[0]
    return manifest[: match.start()] + render_block(body, match["indent"], source) + manifest[match.end() :]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 with a diff if out of date")
    parser.add_argument(
        "--source", type=Path, default=SOURCE, help=f"serve config (default: {SOURCE.relative_to(REPO)})"
    )
    parser.add_argument("--target", type=Path, default=TARGET, help=f"RayService (default: {TARGET.relative_to(REPO)})")
    ns = parser.parse_args(argv)

    source, target = ns.source.resolve(), ns.target.resolve()
    current = target.read_text()
    updated = regenerate(current, serve_config_body(source), source)

    # The copy must mean exactly what the source means, whatever the text looks like.
    embedded = yaml.safe_load(updated)["spec"]["serveConfigV2"]
    if yaml.safe_load(embedded) != yaml.safe_load(source.read_text()):
        raise SystemExit("internal error: the generated serveConfigV2 does not parse to the source config")

    if updated == current:
        print(f"{target.relative_to(REPO) if target.is_relative_to(REPO) else target}: up to date")
        return 0
    if ns.check:
        sys.stdout.writelines(
            difflib.unified_diff(
                current.splitlines(keepends=True),
                updated.splitlines(keepends=True),
                fromfile=f"{target} (committed)",
                tofile=f"{target} (generated)",
            )
        )
        print(f"\n{target} is out of date with {source}: run `python k8s/generate.py`", file=sys.stderr)
        return 1
    target.write_text(updated)
    print(f"wrote serveConfigV2 of {target} from {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
