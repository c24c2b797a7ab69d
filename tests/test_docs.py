"""The README (the quickstart) and the guides in docs/ stay true to the repository they describe.

- the README is a quickstart: at most 150 lines;
- every relative link of the README, docs/*.md and infra/README.md points to a file that exists, and an `#anchor`
  into a Markdown file to one of its headings; every repository path named in backticks exists;
- every `rlhf ...` line of their code blocks parses against the real CLI (subcommands, options, choices, arguments),
  and every `rlhf <subcommand>` they name in inline code exists;
- every `make <target>` they name is a target of the Makefile;
- every `--set key=value` / `-S key=value` loads through the params model (with the line's `--profile`), every
  `section.key` they name in inline code is a params key, and the TRL and LoRA tables name real `train` keys.

What runs each guide's commands is checked beside the tests that run them: docs/gpus.md in tests/test_cpu_profiles.py,
docs/scaling-out.md in tests/test_infra.py, the MLflow links in tests/test_mlflow_tracking.py.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import typing
from pathlib import Path

import pytest
import typer
from pydantic import BaseModel

from cli.main import app
from tasks.parameters.params import Params, ParamsError, load_params

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
GUIDES = sorted((REPO / "docs").glob("*.md"))
DOCS = [README, *GUIDES, REPO / "infra" / "README.md"]
# repository paths the docs name that a run or a setup step creates (git-ignored), not the checkout
GENERATED = {"bench/.gpu-wheels", "bench/.trl-venv", "bench/.trl116", ".venv-trl116", "infra/.state/", "infra/.env", "reports/ui/", ".dvc/tmp/",
             ".dvc/tmp/rlhf-pipeline.lock", ".dvc/cache"}
SOURCE_DIRS = ("rlhf_core/", "tasks/", "flows/", "cli/", "tests/", "bench/", "infra/", "profiles/", "docs/", ".dvc/",
               ".ci/")
SECTIONS = tuple(Params.model_fields)
PLACEHOLDER_KEYS = {"key", "section.key"}  # `--set section.key=value` in a usage line


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def code_blocks(text: str) -> list[str]:
    return re.findall(r"^```[\w-]*\n(.*?)^```", text, flags=re.S | re.M)


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^```[\w-]*\n.*?^```", "", text, flags=re.S | re.M)


def inline_code(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", prose(text))


def command_lines(text: str) -> list[str]:
    """Every line of the code blocks, without a leading `$ `, environment assignments or `.venv/bin/`."""
    lines = []
    for block in code_blocks(text):
        for line in block.splitlines():
            line = line.strip().removeprefix("$ ")
            while re.match(r"^[A-Z_][A-Z0-9_]*=\S*\s", line):  # VAR=value command
                line = line.split(None, 1)[1]
            lines.append(line.removeprefix(".venv/bin/"))
    return lines


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file (code blocks left out)."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", prose(markdown), flags=re.M):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


# ------------------------------------------------------------------ the quickstart


def test_the_readme_is_a_quickstart_that_links_every_guide():
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; the quickstart holds at most 150 (move the rest to docs/)"
    text = README.read_text()
    for command in ("make run", "make test", "make test-server", "make test-gpu", "make test-ui"):
        assert f"`{command}`" in text or f"\n{command} " in text, f"the README no longer names `{command}`"
    unlinked = [rel(g) for g in GUIDES if f"]({rel(g)})" not in text]
    assert not unlinked, f"guides the README does not link: {unlinked}"
    for guide in GUIDES:
        first = guide.read_text().splitlines()
        assert first[0].startswith("# ") and first[1] == "" and first[2], f"{rel(guide)}: a title, then an intro line"


# ------------------------------------------------------------------ links and paths


def links(doc: Path) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", prose(doc.read_text()))


def broken_links(doc: Path) -> list[str]:
    broken = []
    for link in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link):  # https:, mailto: ...
            continue
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        if not path.exists():
            broken.append(f"{link} (no {path.relative_to(REPO) if path.is_relative_to(REPO) else path})")
        elif anchor and path.suffix == ".md" and anchor not in github_anchors(path.read_text()):
            broken.append(f"{link} (no heading #{anchor} in {path.relative_to(REPO)})")
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_relative_link_points_to_a_file_and_heading_that_exist(doc):
    assert links(doc) or doc == REPO / "infra" / "README.md"
    assert not broken_links(doc), f"{rel(doc)}: broken links {broken_links(doc)}"


def test_a_broken_link_is_caught(tmp_path):
    """The link check can fail: a missing file, a missing heading, a link relative to the wrong folder."""
    doc = REPO / "docs" / "gpus.md"
    fake = doc.parent / "_broken_for_test.md"
    try:
        fake.write_text("# t\n\n[a](nope.md) [b](gpus.md#no-such-heading) [c](bench/RESULTS.md) [d](gpus.md#lora)\n"
                        "[e](../bench/RESULTS.md) [f](#t)\n")
        assert broken_links(fake) == ["nope.md (no docs/nope.md)", "gpus.md#no-such-heading (no heading "
                                      "#no-such-heading in docs/gpus.md)", "bench/RESULTS.md (no docs/bench/RESULTS.md)"]
    finally:
        fake.unlink()


def test_the_anchor_slugs_are_githubs():
    assert github_anchors("# Against TRL 1.9.0, side by side\n## 1. Laptop\n## `rlhf bench`\n## Tested\n## Tested\n"
                          "```\n# a comment\n```\n") == {"against-trl-190-side-by-side", "1-laptop", "rlhf-bench",
                                                        "tested", "tested-1"}


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_repository_path_named_exists(doc):
    text = doc.read_text()
    named = {span for span in inline_code(text) if span.startswith(SOURCE_DIRS)}
    named |= {word for line in command_lines(text) for word in line.split() if word.startswith(SOURCE_DIRS)}
    missing = []
    for path in sorted(named):
        path = path.rstrip(".,;:)")
        if re.search(r"[<>*{}|$ ]", path) or any(path.startswith(g) for g in GENERATED):
            continue  # a pattern or a placeholder, or made by a run
        if not (REPO / path).exists():
            missing.append(path)
    assert not missing, f"{rel(doc)} names paths that do not exist: {missing}"


# ------------------------------------------------------------------ the CLI


CLI = typer.main.get_command(app)
# click's usage error, from wherever this typer takes click (typer 0.29 vendors it as typer._click)
UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


def is_group(command) -> bool:
    return hasattr(command, "commands")


def parse_cli(args: list[str]) -> None:
    """Parse a command line with the real CLI's parser, descending into groups; raises click's usage errors."""
    command = CLI
    name = "rlhf"
    while True:
        ctx = command.make_context(name, list(args), resilient_parsing=False)
        if not is_group(command):
            return
        protected = ctx._protected_args if hasattr(ctx, "_protected_args") else ctx.protected_args
        rest = [*protected, *ctx.args]
        if not rest:
            return
        name, command, args = command.resolve_command(ctx, rest)
        assert command is not None, f"rlhf: no subcommand {rest[0]!r}"


def rlhf_lines(doc: Path) -> list[str]:
    return [line for line in command_lines(doc.read_text()) if line.startswith("rlhf ")]


@pytest.mark.parametrize("doc", [README, *GUIDES], ids=rel)
def test_every_rlhf_command_parses_against_the_cli(doc):
    failures = []
    for line in rlhf_lines(doc):
        try:
            parse_cli(shlex.split(line, comments=True)[1:])
        except (UsageError, AssertionError) as err:
            failures.append(f"{line}: {err}")
    assert not failures, f"{rel(doc)}: commands the CLI refuses:\n" + "\n".join(failures)


def subcommand_errors(text: str) -> list[str]:
    """`rlhf <subcommand> [<subcommand>]` named in inline code, checked against the CLI's command tree."""
    errors = []
    for span in inline_code(text):
        for words in re.findall(r"(?:^|[\s(])rlhf ((?:[a-z][\w-]*)(?: [a-z][\w-]*)?)", span):
            first, *second = words.split()
            command = CLI.commands.get(first)
            if command is None:
                errors.append(f"`{span}`: no `rlhf {first}`")
            elif is_group(command) and second and second[0] not in command.commands:
                errors.append(f"`{span}`: no `rlhf {first} {second[0]}`")
    return errors


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_rlhf_subcommand_named_exists(doc):
    assert not subcommand_errors(doc.read_text()), f"{rel(doc)}: {subcommand_errors(doc.read_text())}"


def test_a_wrong_command_or_option_is_caught():
    assert subcommand_errors("run `rlhf experiments` or `rlhf models show 3`, `rlhf run --set a.b=1`") == [
        "`rlhf experiments`: no `rlhf experiments`", "`rlhf models show 3`: no `rlhf models show`"]
    for bad in (["run", "--sett", "train.kl_coef=0.1"], ["bench", "--algo", "dpo"], ["models", "show"],
                ["inspect-rm"]):
        with pytest.raises((UsageError, AssertionError)):
            parse_cli(bad)
    parse_cli(["models", "promote", "3", "--reason", "why"])


# ------------------------------------------------------------------ make targets


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+):(?!=)", (REPO / "Makefile").read_text(), flags=re.M))


def named_make_targets(text: str) -> set[str]:
    spans = [*inline_code(text), *command_lines(text)]
    return {target for span in spans for target in re.findall(r"(?:^|[\s(;&])make ([a-z][\w-]*)", span)}


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_make_target_named_exists(doc):
    missing = named_make_targets(doc.read_text()) - make_targets()
    assert not missing, f"{rel(doc)} names make targets the Makefile lacks: {sorted(missing)}"


def test_a_missing_make_target_is_caught():
    assert named_make_targets("`make run` and\n```bash\nmake lint   # x\nmake nonesuch\n```\n") - make_targets() == {
        "nonesuch"}


# ------------------------------------------------------------------ params keys


def key_exists(key: str, model: type = Params) -> bool:
    """Whether a dotted key is a field of the params model (through nested sections, optional and list items)."""
    head, _, rest = key.partition(".")
    fields = ({f.name: f.type for f in dataclasses.fields(model)} if dataclasses.is_dataclass(model)
              else {name: f.annotation for name, f in model.model_fields.items()})
    if head not in fields:
        return False
    if not rest:
        return True
    candidates = [fields[head]]
    while candidates:
        annotation = candidates.pop()
        if isinstance(annotation, type) and (issubclass(annotation, BaseModel) or dataclasses.is_dataclass(annotation)):
            if key_exists(rest, annotation):
                return True
        candidates.extend(typing.get_args(annotation))
    return False


def overrides(span: str) -> list[str]:
    return re.findall(r"(?:--set|-S)[ =]+([\w.]+=\S+)", span)


def params_errors(text: str) -> list[str]:
    errors = []
    commands = [line for line in command_lines(text) if overrides(line)]
    commands += [span for span in inline_code(text) if overrides(span)]
    for command in commands:
        profile = re.search(r"--profile[ =]+([a-z][\w-]*)", command)  # not a placeholder (NAME)
        items = [item.strip("\"'") for item in overrides(command)]
        placeholders = [item for item in items if item.split("=")[0] in PLACEHOLDER_KEYS
                        or re.fullmatch(r"[A-Z]+", item.split("=", 1)[1])]
        for item in placeholders:  # `--set section.key=value`, `--set base.seed=N`: the key alone
            if item.split("=")[0] not in PLACEHOLDER_KEYS and not key_exists(item.split("=")[0]):
                errors.append(f"{command}: no params key {item.split('=')[0]}")
        try:
            load_params(REPO, profile and profile.group(1), [i for i in items if i not in placeholders])
        except ParamsError as err:
            errors.append(f"{command}: {err}")
    for span in inline_code(text):
        for key in re.findall(rf"^((?:{'|'.join(SECTIONS)})(?:\.\w+)+)(?:=\S*)?$", span):
            if not key_exists(key):
                errors.append(f"`{span}`: no params key {key}")
    return errors


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_params_key_named_is_real(doc):
    errors = params_errors(doc.read_text())
    assert not errors, f"{rel(doc)}:\n" + "\n".join(errors)


def test_a_wrong_params_key_is_caught():
    errors = params_errors("`train.kl_coeff` and `register.max_kl`\n```bash\nrlhf run --set train.klcoef=0.1\n"
                           "dvc exp run -S train.kl_coef=0.1\n```\n")
    assert len(errors) == 2 and "train.klcoef" in errors[0] and "train.kl_coeff" in errors[1], errors
    assert key_exists("prepare.world.conversational") and key_exists("train.rloo.kl_level")
    assert key_exists("train.reward_funcs.model") and not key_exists("train.rloo.nope")


@pytest.mark.parametrize(("guide", "header"), [("trl.md", "| ours |"), ("gpus.md", "| `train.` (TRL `ModelConfig`) |")])
def test_the_key_tables_name_real_train_keys(guide, header):
    """The first column of the TRL mapping (docs/trl.md) and of the LoRA table (docs/gpus.md) holds `train` keys."""
    text = (REPO / "docs" / guide).read_text()
    assert header in text, f"docs/{guide} lost its table"
    rows = text[text.index(header):].split("\n\n")[0].splitlines()[2:]
    cells = [row.split("|")[1].strip() for row in rows]
    keys = [key for cell in cells for key in re.findall(r"`([a-z_][\w.]*)`", cell)
            if cell.startswith("`") or key.startswith(tuple(f"{s}." for s in SECTIONS))]  # not prose's `prompt`
    assert len(keys) >= 8, keys
    unknown = [k for k in keys if not (key_exists(k) if k.startswith(tuple(f"{s}." for s in SECTIONS))
                                       else key_exists(f"train.{k}"))]
    assert not unknown, f"docs/{guide}: not params keys: {unknown}"
