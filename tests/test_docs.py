"""The documentation: the README stays a landing page, every relative link resolves, the site builds strictly."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from tests.helpers.paths import REPOSITORY

ROOT = REPOSITORY
README = ROOT / "README.md"
README_LIMIT = 8 * 1024
"""Bytes: the README is a landing page (issue 33 §6); everything else lives in docs/."""
SETUP = "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0"
QUICKSTART_COMMANDS = (
    f"{SETUP} && pip install -e . && dplit fit --config configs/quickstart.yaml",
    f'{SETUP} && pip install -e ".[test]" && python -m pytest -q',
)
"""The README's Quickstart, verbatim: one command sets up and runs the main job offline, one runs the tests."""

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)


def markdown_files() -> list[Path]:
    """README.md, CONTRIBUTING.md, CHANGELOG.md and every page of the site."""
    pages = sorted((ROOT / "docs").rglob("*.md"))
    return [ROOT / name for name in ("README.md", "CONTRIBUTING.md", "CHANGELOG.md")] + pages


def link_targets(text: str) -> list[str]:
    """Targets of the inline, image and reference links in markdown ``text``, code blocks and spans left out."""
    prose = INLINE_CODE.sub("", FENCE.sub("", text))
    return INLINE_LINK.findall(prose) + REFERENCE_LINK.findall(prose)


def relative_path(target: str) -> str | None:
    """The file part of a relative link, or ``None`` for a URL, a mail address or an anchor in the same page."""
    parts = urlsplit(target)
    if parts.scheme or parts.netloc or not parts.path:
        return None
    return unquote(parts.path)


def test_link_parser_skips_code_and_urls() -> None:
    text = (
        '[a](docs/index.md) ![b](img/x.png "t") `[c](not/a/link.md)` [d](https://x.org/y.md) [e](#anchor)\n'
        "```\n[f](inside/a/fence.md)\n```\n[g]: docs/reference/cli.md#flags\n"
    )
    targets = link_targets(text)
    assert targets == ["docs/index.md", "img/x.png", "https://x.org/y.md", "#anchor", "docs/reference/cli.md#flags"]
    assert [relative_path(t) for t in targets] == ["docs/index.md", "img/x.png", None, None, "docs/reference/cli.md"]


def test_readme_is_a_landing_page() -> None:
    size = len(README.read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes, over {README_LIMIT}: move the detail to docs/"


def test_readme_quickstart_is_the_two_commands_and_they_hold() -> None:
    text = README.read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"^```bash\n(.*?)\n```$", section, re.MULTILINE | re.DOTALL)
    assert tuple(commands) == QUICKSTART_COMMANDS
    assert (ROOT / "configs" / "quickstart.yaml").is_file()
    test_extra = re.search(r"^test = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert test_extra and '"pytest' in test_extra.group(1)  # pip install -e ".[test]" brings pytest
    assert "python -m pytest -q" in (ROOT / ".ci" / "run").read_text()  # CI runs the README's test command


@pytest.mark.parametrize("page", [README, ROOT / "docs" / "tutorials" / "first-dp-fine-tune.md"], ids=lambda p: p.name)
def test_the_quickstarts_time_says_it_is_trainings_alone(page: Path) -> None:
    """Issue 50: "about two minutes" was the training; the line with its installs took 3 min 07 s."""
    intro = page.read_text().split(f"\n\n```bash\n{QUICKSTART_COMMANDS[0]}", 1)[0].rsplit("\n\n", 1)[1]
    sentence = " ".join(intro.split())
    assert "training takes about two minutes on 2 CPU cores, the installs about one more" in sentence, sentence


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in link_targets(page.read_text()):
        path = relative_path(target)
        if path is not None and not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files: {broken}"


@pytest.mark.slow
def test_docs_build_strictly_without_a_warning(tmp_path: Path) -> None:
    environment = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml")]
    result = subprocess.run(
        [*command, "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        check=False,
    )
    output = result.stdout + result.stderr
    assert "No module named mkdocs" not in output, 'mkdocs is missing: pip install -e ".[test]"'
    assert result.returncode == 0, output
    assert not re.search(r"^(WARNING|ERROR)\b", output, re.MULTILINE), output
    knobs = (tmp_path / "site" / "reference" / "dp-knobs" / "index.html").read_text()
    assert 'class="doc doc-object' in knobs, "the DP knob reference is no longer generated by mkdocstrings"
