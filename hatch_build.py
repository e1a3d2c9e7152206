"""Build the wasm core from core/ with the pinned Zig and ship it inside the wheel as devd/core.wasm."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


def build_core(root: Path, dest: Path) -> None:
    """Run `zig build` in core/ and copy the module to dest. The build is reproducible: same source, same bytes."""
    with tempfile.TemporaryDirectory(prefix="devd-core-") as prefix:
        subprocess.run(
            [sys.executable, "-m", "ziglang", "build", "--prefix", prefix],
            cwd=root / "core",
            check=True,
        )
        shutil.copyfile(Path(prefix) / "bin" / "devd_core.wasm", dest)


class CoreBuildHook(BuildHookInterface):  # type: ignore[type-arg]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        root = Path(self.root)
        build_core(root, root / "devd" / "core.wasm")
