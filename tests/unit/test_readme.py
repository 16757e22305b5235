"""The command lines README.md quotes are the ones the code accepts and builds.

Every ``nanotron-recover ...`` line (code blocks and inline code) parses with the real CLI parser
(argparse, nothing runs); the ``mpirun`` flags quoted for ``launch`` are those
``launcher.mpirun_command`` builds, with and without the heartbeat detector; the ``mpirun`` line
quoted for the Slurm job is the rendered job script's; every ``python benchmarks/...`` line names
a script that takes the flags quoted; and every option quoted on its own (``--stop-after-step N``)
exists in one of those parsers, the job script or mpirun's line.
"""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from nanotron_recover import launcher
from nanotron_recover.cli import build_parser
from nanotron_recover.config import load_config
from nanotron_recover.slurm import render_sbatch

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
WILDCARD = "..."


def bash_lines(text: str) -> list[str]:
    """The commands of the ```bash blocks: continuation lines joined, comments and ``&&`` split."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            for part in line.split(" #")[0].split("&&"):
                if part.strip():
                    lines.append(" ".join(part.split()))
    return lines


def inline_code(text: str) -> list[str]:
    """The inline code spans of the prose (outside code blocks), line breaks inside them joined."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]


def quoted_cli_commands() -> list[str]:
    """Lines to run: the code blocks' ``nanotron-recover`` lines, and inline ones with an argument
    (not only options: ``nanotron-recover convert --from-hf`` in a sentence names an option)."""
    lines = [c for c in bash_lines(README) if c.startswith("nanotron-recover ")]
    for span in inline_code(README):
        if re.match(r"nanotron-recover [a-z-]+( |$)", span):
            words = span.split()[2:]
            if words and not all(w.startswith("-") for w in words):
                lines.append(span)
    return lines


def quoted_cli_mentions() -> list[str]:
    """Inline ``nanotron-recover <command> [--option...]``: the command and its options named."""
    return [
        span
        for span in inline_code(README)
        if re.match(r"nanotron-recover [a-z-]+( |$)", span) and span not in quoted_cli_commands()
    ]


def argv_of(command: str, program: str) -> list[str]:
    """The arguments after ``program``: optional ``[...]`` parts included, ``...`` left out."""
    tokens = shlex.split(command.replace("[", " ").replace("]", " "))
    assert tokens[0] == program, command
    return [t for t in tokens[1:] if t != WILDCARD]


def subcommands() -> dict[str, object]:
    parser = build_parser()
    (action,) = [a for a in parser._actions if a.dest == "command"]
    return dict(action.choices)


def matches(pattern: list[str], tokens: list[str]) -> bool:
    """Whether ``tokens`` is ``pattern`` where each ``...`` stands for one or more tokens."""
    if not pattern:
        return not tokens
    if pattern[0] == WILDCARD:
        return any(matches(pattern[1:], tokens[k:]) for k in range(1, len(tokens) + 1))
    return bool(tokens) and pattern[0] == tokens[0] and matches(pattern[1:], tokens[1:])


def test_the_readme_quotes_commands():
    commands = quoted_cli_commands()
    assert len(commands) >= 20, commands  # the extraction itself works
    assert {c.split()[1] for c in commands} >= {"demo", "train", "launch", "slurm", "compare", "preprocess"}


@pytest.mark.parametrize("command", quoted_cli_commands())
def test_every_quoted_command_parses(command: str):
    argv = argv_of(command, "nanotron-recover")
    assert argv[0] in subcommands(), f"README quotes a command that does not exist: {command}"
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"README's command line is refused by the CLI parser: {command}")
    assert args.command == argv[0]
    # argparse takes abbreviations: each option must be spelled out as the parser names it.
    options = subcommands()[argv[0]]._option_string_actions  # type: ignore[attr-defined]
    abbreviated = [a for a in argv[1:] if a.startswith("--") and a.split("=")[0] not in options]
    assert abbreviated == [], f"README abbreviates or misspells {abbreviated}: {command}"


@pytest.mark.parametrize("mention", quoted_cli_mentions())
def test_every_command_named_in_a_sentence_exists_with_its_options(mention: str):
    if mention.startswith("nanotron-recover launch:"):
        return  # the prefix of launch's own lines
    command, *options = mention.split()[1:]
    parser = subcommands().get(command)
    assert parser is not None, f"README names a command that does not exist: {mention}"
    unknown = [o for o in options if o not in parser._option_string_actions]  # type: ignore[attr-defined]
    assert unknown == [], f"nanotron-recover {command} has no {unknown}"


# -- mpirun -------------------------------------------------------------------------------------------
def quoted_mpirun(start: str, containing: str = "") -> list[str]:
    (span,) = [s for s in inline_code(README) if s.startswith(start) and containing in s]
    return shlex.split(span)


@pytest.fixture
def plain_user(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not root (the README says root adds --allow-run-as-root), and mpirun found by name."""
    monkeypatch.setattr(launcher.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(launcher, "mpirun_path", lambda: "mpirun")


def test_the_launch_line_quoted_is_the_one_launch_builds(plain_user):
    quoted = quoted_mpirun("mpirun --with-ft ulfm", "-n tp*pp*dp python -m nanotron_recover.cli train ...")
    n = quoted.index("-n")
    built = launcher.mpirun_command(8, ["python", "-m", "nanotron_recover.cli", "train"])
    assert quoted[:n] == built[: built.index("-n")]
    assert quoted[n + 2 : n + 6] == ["python", "-m", "nanotron_recover.cli", "train"]


def test_the_heartbeat_flags_quoted_are_the_ones_launch_adds(plain_user):
    quoted = quoted_mpirun("--mca mpi_ft_detector true")
    period, timeout = 1.5, 7.0
    substituted = [{"P": f"{period:g}", "T": f"{timeout:g}"}.get(t, t) for t in quoted]
    assert substituted == launcher.heartbeat_flags((period, timeout))
    plain = launcher.mpirun_command(8, ["prog"])
    forward = launcher.mpirun_command(8, ["prog"], heartbeat=(period, timeout))
    k = plain.index("--bind-to")
    assert forward == plain[:k] + substituted + plain[k:]  # "it also turns on" the detector


def rendered_job(config: str, nodes: int, gpus: int, overrides: list[str], spare_nodes: int = 0) -> str:
    cfg = load_config(REPO / config, overrides, check_paths=False)  # data/c4-llama need not exist
    return render_sbatch(
        cfg,
        config,
        nodes=nodes,
        gpus_per_node=gpus,
        partition="gpu",
        time="60",
        job_name=None,
        run_dir="runs/x",
        overrides=overrides,
        spare_nodes=spare_nodes,
    )


def job_mpirun_tokens(script: str) -> list[str]:
    """The job script's ``CMD=(...)`` mpirun line as tokens: arrays the script fills in literally
    are expanded, arrays filled at run time (root, environment forwarding) left out."""
    arrays = {name: shlex.split(body) for name, body in re.findall(r"^([A-Z_]+)=\((.*?)\)$", script, re.M)}
    (cmd,) = re.findall(r"^CMD=\((.*?)\)$", script, re.M | re.S)
    tokens = []
    for token in shlex.split(cmd):
        array = re.fullmatch(r"\$\{([A-Z_]+)\[@\]\}", token)
        if array:
            tokens += arrays.get(array.group(1), [])
        else:
            tokens.append({"$MPIRUN": "mpirun", "$PYTHON": "python"}.get(token, token))
    return tokens


def test_the_slurm_job_line_quoted_is_the_rendered_one():
    quoted = quoted_mpirun("mpirun --with-ft ulfm", "--map-by ppr:G:node")
    # llama1b_c4 on 4 nodes x 4 GPUs: tp=2 x dp=8 = 16 ranks, 4 per node.
    shape = {"G": "4", "tp*pp*dp": "16"}
    pattern = [re.sub(r"ppr:G:", "ppr:4:", shape.get(t, t)) for t in quoted]
    tokens = job_mpirun_tokens(rendered_job("configs/llama1b_c4.yaml", 4, 4, ["recover.max_restarts=3"]))
    assert matches(pattern, tokens), f"README: {' '.join(quoted)}\njob:    {' '.join(tokens)}"


def test_the_spare_nodes_mapping_and_the_supervisor_line_quoted_are_in_the_job():
    script = rendered_job("configs/llama7b_c4.yaml", 64, 8, ["recover.rejoin.mode=spawn"], spare_nodes=2)
    tokens = job_mpirun_tokens(script)
    quoted = quoted_mpirun("mpirun --map-by ppr:8:node:NOOVERSUBSCRIBE")
    assert matches([quoted[0], WILDCARD, *quoted[1:3], WILDCARD, *quoted[3:5], WILDCARD], tokens)
    assert "#SBATCH --nodes=66" in script
    supervisor = quoted_mpirun("python -m nanotron_recover.supervisor supervise")
    assert " ".join(supervisor[:5]) in script.replace('"$PYTHON"', "python")


# -- benchmarks and options quoted on their own -----------------------------------------------------
def flags_of_script(path: Path) -> set[str]:
    """The option strings a script's argparse calls declare."""
    flags = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            flags |= {
                a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")
            }
    return flags


def benchmark_lines() -> list[str]:
    lines = [c for c in bash_lines(README) + inline_code(README) if c.startswith("python benchmarks/")]
    return sorted(set(lines))


def test_the_readme_quotes_the_benchmarks():
    assert len(benchmark_lines()) >= 10


@pytest.mark.parametrize("line", benchmark_lines())
def test_every_quoted_benchmark_takes_its_flags(line: str):
    argv = argv_of(line, "python")
    script = REPO / argv[0]
    assert script.is_file(), f"README quotes {argv[0]}, which does not exist"
    missing = [f for f in argv[1:] if f.startswith("-") and f.split("=")[0] not in flags_of_script(script)]
    assert missing == [], f"{argv[0]} does not take {missing}"


def known_options() -> set[str]:
    """Every option the README may quote on its own: the CLI's, the supervisor's, the benchmarks',
    the Slurm job script's (sbatch and mpirun) and launch's mpirun line."""
    options = {o for p in subcommands().values() for o in p._option_string_actions}  # type: ignore[attr-defined]
    options |= flags_of_script(REPO / "src" / "nanotron_recover" / "supervisor.py")
    for script in (REPO / "benchmarks").glob("*.py"):
        options |= flags_of_script(script)
    job = rendered_job("configs/llama7b_c4.yaml", 64, 8, ["recover.rejoin.mode=spawn"], spare_nodes=2)
    options |= {t.split("=")[0] for t in re.findall(r"--[a-z][a-z-]*(?:=\S*)?", job)}
    options |= set(launcher.mpirun_command(8, ["prog"], heartbeat=(1, 5)))
    return options


def test_every_option_quoted_on_its_own_exists():
    # Options of other tools the README quotes while explaining them (Slurm's, pip's, Open MPI's
    # runtime in a relaunch line).
    others = {"--no-binary", "--requeue", "--overlap", "--host", "--allow-run-as-root", "--oversubscribe"}
    quoted = {re.split(r"[= ]", span)[0] for span in inline_code(README) if re.match(r"--[a-z]", span)}
    unknown = sorted(quoted - known_options() - others)
    assert unknown == [], f"README quotes options nothing takes: {unknown}"


def test_the_install_lines_name_an_extra_and_a_torch_the_package_accepts():
    pyproject = (REPO / "pyproject.toml").read_text()
    installs = [c for c in bash_lines(README) if c.startswith("pip install ") and "-e" in c]
    assert installs, "README quotes no install line"
    extras = set(re.findall(r"^(\w+) = \[", pyproject.split("[project.optional-dependencies]")[1], re.M))
    (torch_dep,) = [Requirement(d) for d in re.findall(r'"(torch[^"]*)"', pyproject)]
    for line in installs:
        for extra in re.findall(r"\.\[(\w+)\]", line):
            assert extra in extras, f"{line}: pyproject.toml has no extra {extra!r}"
        for pin in re.findall(r"torch==([\w.]+)", line):
            assert torch_dep.specifier.contains(pin), f"{line}: torch {pin} is outside {torch_dep}"


# -- the recover: tables ----------------------------------------------------------------------------
def table_fields(heading: str) -> set[str]:
    """The field names in the first column of the README table headed ``| `<heading>` field |``."""
    match = re.search(rf"^\| `{re.escape(heading)}` field \|.*?\n((?:\|.*\n)+)", README, re.M)
    assert match, f"no README table for {heading}"
    fields = set()
    for row in match.group(1).splitlines()[1:]:  # after the |---| line
        first = row.split("|")[1]
        fields.update(re.findall(r"`(\w+)`", first))
    return fields


@pytest.mark.parametrize(
    ("heading", "args"),
    [("recover:", "RecoverArgs"), ("recover.rejoin:", "RejoinArgs")],
)
def test_every_recover_field_is_in_its_readme_table_and_no_other(heading: str, args: str):
    """The README's tables of ``recover:`` and ``recover.rejoin:`` name every field the config
    accepts there, and only those (``snapshot`` names its own fields inline)."""
    import dataclasses

    from nanotron_recover import config

    fields = {f.name for f in dataclasses.fields(getattr(config, args))}
    assert table_fields(heading) == fields


def test_every_snapshot_field_is_named_in_the_recover_table():
    import dataclasses

    from nanotron_recover.config import SnapshotArgs

    row = next(line for line in README.splitlines() if line.startswith("| `snapshot` |"))
    assert {f.name for f in dataclasses.fields(SnapshotArgs)} <= set(re.findall(r"`(\w+)`", row))
