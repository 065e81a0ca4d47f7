"""The docs' offline ``dplit`` commands, extracted from README.md, the tutorials and the how-tos, and run as written.

Every ``dplit`` command in a shell block of those pages whose config is an offline one (the quickstarts), or that
exports or samples what such a run wrote, is either in a walkthrough below, which runs it in a fresh folder in the
order a reader meets it (``configs/`` beside, so the relative paths of the docs hold), or named in :data:`NOT_RUN`
with the test that runs it instead. A new offline command in the docs that is in neither fails the test; so does
a walkthrough command the docs no longer hold. Runs take a few steps (``--trainer.max_steps``) and few samples:
overrides appended to the command, which otherwise runs verbatim, in process (:func:`run_dplit_in_process`).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.helpers.executable import run_dplit_in_process
from tests.helpers.paths import REPOSITORY

PAGES = [REPOSITORY / "README.md", *sorted((REPOSITORY / "docs" / "tutorials").glob("*.md")),
         *sorted((REPOSITORY / "docs" / "how-to").glob("*.md"))]  # fmt: skip
OFFLINE_CONFIGS = ("configs/quickstart.yaml", "configs/lm_quickstart.yaml")
SHELL_BLOCKS = ("bash", "sh", "shell", "console", "")

QUICKSTART = "dplit fit --config configs/quickstart.yaml"
LAST = "lightning_logs/version_0/checkpoints/last.ckpt"
EXPORT = f"dplit export --ckpt_path {LAST} --output_dir my-private-model"
SHORT = ("--trainer.max_steps", "1")
RESUME = f"dplit fit --config configs/quickstart.yaml --ckpt_path {LAST}"
RESUME_LAST = "dplit fit --config configs/quickstart.yaml --ckpt_path last"
MEMORY = "dplit fit --config configs/quickstart.yaml --model.gradient_checkpointing true --model.checkpointed_share 0.5"
CLIP_MODE = "dplit fit --config configs/quickstart.yaml --trainer.strategy.init_args.clip_mode"

WALKTHROUGHS: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    # README's quickstart and its first more command, the tutorial top to bottom, export.md, resume.md
    "classifier": [
        (QUICKSTART, SHORT),
        (f"dplit validate --config configs/quickstart.yaml --ckpt_path {LAST}", ()),
        (EXPORT, ()),
        (RESUME, SHORT),  # the quickstart's plan is done: both resumes have nothing to do, and say so
        (RESUME_LAST, SHORT),
        (MEMORY, SHORT),  # memory.md's offline variant
    ],
    # the tutorial's step 5 and language-model.md (their fit is generate.md's, in its own folder), generate.md
    "language model": [
        ("dplit lm validate --config configs/lm_quickstart.yaml", ()),
        ("dplit lm fit --config configs/lm_quickstart.yaml --trainer.default_root_dir lm_run", SHORT),
        (
            "dplit export --ckpt_path lm_run/lightning_logs/version_0/checkpoints/last.ckpt --output_dir my-private-lm",
            (),
        ),
        (
            "dplit lm generate --model my-private-lm --prompts_file prompts.jsonl --num_samples 100 "
            "--output_file synthetic.jsonl",
            ("--num_samples", "2", "--max_new_tokens", "4"),
        ),
    ],
}
"""Each walkthrough runs in its own folder: (the command as the docs give it, the overrides appended to it)."""

PROMPTS = '{"prompt": "The movie was"}\n{"prompt": "I found it"}\n'
"""``prompts.jsonl`` as generate.md's ``printf`` writes it (public control prompts)."""

NOT_RUN = {
    "dplit audit --config configs/quickstart.yaml --audit.canaries 1000": "tests/audit/test_audit.py",
    "dplit audit --config configs/quickstart.yaml --audit.mode black_box": "tests/audit/test_audit.py",
    "dplit lm audit --config configs/lm_quickstart.yaml": "tests/audit/test_audit.py (test_lm_audit_on_a_tiny_llama)",
    "dplit lm fit --config configs/lm_quickstart.yaml": "here, as generate.md's with --trainer.default_root_dir",
    f"{CLIP_MODE} quantile": "tests/cli/test_terminal.py (test_the_start_up_line_names_the_clip_mode_and_the_unit)",
    f"{CLIP_MODE} automatic": "tests/cli/test_terminal.py (test_the_start_up_line_names_the_clip_mode_and_the_unit)",
    "dplit fit --config configs/quickstart.yaml --data.privacy_unit user --data.max_rows_per_user 4": (
        "tests/privacy/test_user_level.py (these flags on the quickstart, 200 rows: the 20,000 rows' steps take ~25 s)"
    ),
}
"""Offline commands of the docs run elsewhere (each fit here costs seconds: audits train with canaries, user-level
steps are slow, the clip modes run on 200 rows there); each is still parsed here (``--print_config``).

The value names the test that runs them."""


def shell_lines(text: str) -> list[str]:
    r"""The lines of the page's shell blocks, ``\`` continuations joined, comments after the command dropped."""
    lines, block, pending = [], None, ""
    for line in text.splitlines():
        fence = re.match(r"^\s*```\s*(\w*)", line)
        if fence:
            block = fence.group(1) if block is None else None
            continue
        if block is None or block not in SHELL_BLOCKS:
            continue
        pending += line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        lines.append(re.sub(r"\s+#\s.*$", "", pending).strip())
        pending = ""
    return lines


def dplit_commands(text: str) -> list[str]:
    """Every ``dplit ...`` command of the page's shell blocks (also after ``&&``), whitespace normalised."""
    segments = [part.strip() for line in shell_lines(text) for part in line.split("&&")]
    return [" ".join(part.split()) for part in segments if part.startswith("dplit ")]


def is_offline(command: str) -> bool:
    """A command that needs no hub and no file of the reader's: a quickstart config, or what such a run wrote."""
    words = shlex.split(command)
    if "..." in command or any(word.startswith(("my/", "my_")) for word in words):
        return False  # a placeholder path the reader fills in
    if "--config" in words:
        return words[words.index("--config") + 1] in OFFLINE_CONFIGS
    return words[1] == "export" or words[1:3] == ["lm", "generate"]


def offline_commands() -> set[str]:
    """The offline ``dplit`` commands of :data:`PAGES`."""
    return {command for page in PAGES for command in dplit_commands(page.read_text()) if is_offline(command)}


def test_the_extraction_finds_commands_after_installs_and_across_continuations() -> None:
    text = "x\n```bash\npip install -e . && dplit fit --config configs/quickstart.yaml\ndplit fit \\\n  --config a.yaml  # why\n```\n"
    assert dplit_commands(text) == [QUICKSTART, "dplit fit --config a.yaml"]
    assert dplit_commands("```yaml\n# dplit fit --config configs/quickstart.yaml\n```\n") == []


def test_no_shell_block_continues_a_line_after_a_comment() -> None:
    r"""``cmd \  # why`` ends the command at the comment (``\ `` escapes a space): the next lines run on their own."""
    broken = [
        f"{page.relative_to(REPOSITORY)}: {line.strip()}"
        for page in PAGES
        for line in page.read_text().splitlines()
        if re.search(r"\\\s+#", line)
    ]
    assert broken == []


def test_the_prompts_file_is_the_one_generate_md_writes() -> None:
    text = (REPOSITORY / "docs" / "how-to" / "generate.md").read_text()
    printf = next(line for line in shell_lines(text) if line.startswith("printf "))
    assert shlex.split(printf)[1].replace("\\n", "\n") == PROMPTS and printf.endswith("> prompts.jsonl")


def test_every_offline_command_of_the_docs_is_run_here_or_named_where_it_is_run() -> None:
    walked = {command for steps in WALKTHROUGHS.values() for command, _ in steps}
    found = offline_commands()
    assert found - walked - set(NOT_RUN) == set(), "an offline command of the docs that no test runs"
    assert (walked | set(NOT_RUN)) - found == set(), "a command the docs no longer give"


@pytest.mark.parametrize("command", sorted(NOT_RUN))
def test_the_offline_commands_run_elsewhere_parse_as_written(command: str, tmp_path: Path) -> None:
    """Every flag of the command exists and takes its value (the config is read, nothing is trained)."""
    (tmp_path / "configs").symlink_to(REPOSITORY / "configs")
    result = run_dplit_in_process(*shlex.split(command)[1:], "--print_config", cwd=tmp_path)
    assert result.returncode == 0 and "dplit: error:" not in result.stderr, result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("walkthrough", sorted(WALKTHROUGHS))
def test_the_docs_offline_commands_run_as_written(walkthrough: str, tmp_path: Path) -> None:
    """In a fresh folder beside ``configs/``: each command exits 0 without an error line, in the docs' order."""
    (tmp_path / "configs").symlink_to(REPOSITORY / "configs")
    (tmp_path / "prompts.jsonl").write_text(PROMPTS)
    outputs = {}
    for command, overrides in WALKTHROUGHS[walkthrough]:
        result = run_dplit_in_process(*shlex.split(command)[1:], *overrides, cwd=tmp_path)
        outputs[command] = output = result.stdout + result.stderr
        assert result.returncode == 0 and "dplit: error:" not in output, f"{command}\n{output[-3000:]}"
    for resumed in (outputs[command] for command in (RESUME, RESUME_LAST) if command in outputs):
        assert "dplit: nothing to train:" in resumed and "NON-PRIVATE" not in resumed, resumed[-3000:]
