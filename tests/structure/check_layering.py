#!/usr/bin/env python3
"""Fails when a project include crosses a layer the wrong way.

Layers, lowest first: core; comm and optim over core; text over core; in models/, the ops, the
interface (the generic files), the families (one folder each) and the registry; trainer/ and
tools/ on top. A family is known above it only through the registry: registry.cpp is the one
file that names a family's header.

Usage: check_layering.py REPOSITORY_ROOT
"""
import pathlib
import re
import sys

SOURCE_DIRS = ("core", "comm", "optim", "text", "models", "trainer", "tools")
SUFFIXES = {".h", ".cpp", ".cu", ".cuh"}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
REGISTRY_FILES = {"models/registry.h", "models/registry.cpp", "models/hf_folder.h", "models/hf_folder.cpp"}


def layer(path):
    """The layer of a repository path such as models/qwen3/model.h."""
    parts = path.split("/")
    top = parts[0]
    if top != "models":
        return top
    if path in REGISTRY_FILES:
        return "registry"
    if len(parts) == 2:
        return "interface"
    if parts[1] == "ops":
        return "ops"
    return "family:" + parts[1]


BASE = {"core"}
ALLOWED = {
    "core": BASE,
    "comm": BASE | {"comm"},
    "optim": BASE | {"optim"},
    "text": BASE | {"text"},
    "ops": BASE | {"optim", "ops"},
    "interface": BASE | {"optim", "ops", "interface"},
    "registry": BASE | {"optim", "ops", "interface", "registry"},
}


def problem(source, target):
    """Why `source` may not include `target` (repository paths), or None."""
    src, dst = layer(source), layer(target)
    if src.startswith("family:"):
        if dst.startswith("family:") and dst != src:
            return "families know each other not"
        if dst in ("registry", "trainer", "tools", "text", "comm"):
            return "a family sits below the " + dst
        return None
    if dst.startswith("family:"):
        if source == "models/registry.cpp" and target.endswith("/family.h"):
            return None
        if src == "ops":
            return "ops know no family"
        if src == "registry":
            return "only models/registry.cpp names a family"
        return src + " knows families only through the registry (models/registry.h)"
    if src in ALLOWED and dst not in ALLOWED[src]:
        return src + " sits below " + dst
    if src == "trainer" and dst == "tools":
        return "trainer sits below tools"
    return None


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    failures = []
    checked = 0
    for top in SOURCE_DIRS:
        for file in sorted((root / top).rglob("*")):
            if file.suffix not in SUFFIXES or not file.is_file():
                continue
            source = file.relative_to(root).as_posix()
            checked += 1
            for number, line in enumerate(file.read_text(errors="replace").splitlines(), 1):
                match = INCLUDE.match(line)
                if not match:
                    continue
                target = match.group(1)
                if target.split("/")[0] not in SOURCE_DIRS:
                    continue  # a file next to it, or a library's
                why = problem(source, target)
                if why:
                    failures.append(f"{source}:{number}: includes {target}: {why}")
    for failure in failures:
        print(failure)
    if failures:
        print(f"{len(failures)} wrong-way include(s) in {checked} files")
        return 1
    print(f"layering: {checked} files, every include points down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
