"""``.ci/run`` (the CI entry point) runs the README's test command, and lints as documented."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_test_command() -> str:
    section = (ROOT / "README.md").read_text().split("## Running the tests", 1)[1]
    blocks = re.findall(r"```\n(.*?)\n```", section, flags=re.S)
    commands = [b.strip() for b in blocks if b.strip().startswith("python -m pytest")]
    assert len(commands) == 1, commands
    return commands[0]


def test_ci_runs_the_readmes_test_command() -> None:
    script = (ROOT / ".ci" / "run").read_text().splitlines()
    runs = [line.strip() for line in script if line.strip().startswith("python -m pytest")]
    assert runs == [readme_test_command()], runs
    assert "ruff check ." in script and any(
        line.startswith("ruff format --check") for line in script
    )
