#!/usr/bin/env python3
"""Write each GPU serve config into its RayService as the serveConfigV2:

    h3serve/deploy/serve_config.gpu.yaml   -> k8s/rayservice.yaml        (H200 nodes)
    h3serve/deploy/serve_config.h100.yaml  -> k8s/rayservice.h100.yaml   (H100 nodes)

The serve config is the one source of truth; the RayService carries a copy between two marker
comments. Only that block is rewritten, so everything else in the manifest (comments, order,
formatting, the worker groups) stays byte for byte as written; tests/test_k8s.py checks the worker
groups against the config (every deployment schedulable, at Serve's minimum and maximum).

    python k8s/generate.py            rewrite the block of every manifest above (make k8s)
    python k8s/generate.py --check    exit 1 and print a diff when one is out of date (make k8s-check)
    python k8s/generate.py --source S --target T    one pair (--target alone: the H200 config's)

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
SOURCE = REPO / "h3serve" / "deploy" / "serve_config.gpu.yaml"
TARGET = REPO / "k8s" / "rayservice.yaml"
# (serve config, RayService): every manifest the repository ships, each generated from its config
PAIRS = (
    (SOURCE, TARGET),
    (REPO / "h3serve" / "deploy" / "serve_config.h100.yaml", REPO / "k8s" / "rayservice.h100.yaml"),
)

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


def regenerate(manifest: str, body: str, source: Path, target: Path = TARGET) -> str:
    matches = list(BLOCK.finditer(manifest))
    if len(matches) != 1:
        raise SystemExit(
            f"{target}: expected exactly one block between '{BEGIN}' and '{END}' "
            f"at the same indentation, found {len(matches)}"
        )
    match = matches[0]
    return manifest[: match.start()] + render_block(body, match["indent"], source) + manifest[match.end() :]


def shown(path: Path) -> Path:
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


def generate(source: Path, target: Path, check: bool) -> bool:
    """Rewrite (or with ``check``, compare) ``target``'s block from ``source``; True when it was up to date."""
    if not target.is_file():
        raise SystemExit(
            f"{target}: no such RayService (write its worker groups first; only serveConfigV2 is generated)"
        )
    current = target.read_text()
    updated = regenerate(current, serve_config_body(source), source, target)

    # The copy must mean exactly what the source means, whatever the text looks like.
    embedded = yaml.safe_load(updated)["spec"]["serveConfigV2"]
    if yaml.safe_load(embedded) != yaml.safe_load(source.read_text()):
        raise SystemExit("internal error: the generated serveConfigV2 does not parse to the source config")

    if updated == current:
        print(f"{shown(target)}: up to date")
        return True
    if check:
        sys.stdout.writelines(
            difflib.unified_diff(
                current.splitlines(keepends=True),
                updated.splitlines(keepends=True),
                fromfile=f"{target} (committed)",
                tofile=f"{target} (generated)",
            )
        )
        print(f"\n{target} is out of date with {source}: run `python k8s/generate.py`", file=sys.stderr)
        return False
    target.write_text(updated)
    print(f"wrote serveConfigV2 of {shown(target)} from {shown(source)}")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 with a diff if out of date")
    parser.add_argument("--source", type=Path, help="one serve config (default: every pair above)")
    parser.add_argument("--target", type=Path, help="its RayService (with --source, or alone for the H200 config's)")
    ns = parser.parse_args(argv)

    if ns.source is None and ns.target is None:
        pairs = list(PAIRS)
    elif ns.target is None:
        paired = {source.resolve(): target for source, target in PAIRS}
        if ns.source.resolve() not in paired:
            parser.error(f"--source {ns.source} has no RayService of its own here: give --target")
        pairs = [(ns.source, paired[ns.source.resolve()])]
    else:
        pairs = [(ns.source if ns.source is not None else SOURCE, ns.target)]
    results = [generate(source.resolve(), target.resolve(), ns.check) for source, target in pairs]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
