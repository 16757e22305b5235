"""Every ``mpirun`` the suite and the benchmarks start goes through ``session_dirs.fresh_session``.

A killed ``mpirun`` leaves its session folder, and a later one that gets its pid cannot start
(exit 213; ``session_dirs.py``). The supervisor starts fresh, and so must every launch written
in the tests and benchmarks: two integration modules that started ``mpirun`` with a bare
``subprocess.Popen`` failed so in one suite run (``PMIx server's listener thread failed to
start``), on a machine holding 199 stale ``ompi.*`` folders. The launches are found by reading the
source: a ``subprocess`` call whose command is, or is built in the same function from, ``MPIRUN``,
``mpirun_command(...)`` or ``train_command(...)`` must pass it through ``fresh_session(...)``.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SUBPROCESS_CALLS = {"Popen", "run", "call", "check_call", "check_output"}
MPIRUN_BUILDERS = {"mpirun_command", "train_command"}


def _called(node: ast.AST) -> str | None:
    """The name a call calls (``f(...)`` or ``x.f(...)``), None for anything else."""
    if not isinstance(node, ast.Call):
        return None
    return getattr(node.func, "id", getattr(node.func, "attr", None))


def _mentions_mpirun(node: ast.AST, built: set[str]) -> bool:
    return any(
        (isinstance(sub, ast.Name) and (sub.id == "MPIRUN" or sub.id in built))
        or _called(sub) in MPIRUN_BUILDERS
        for sub in ast.walk(node)
    )


FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _own_nodes(scope: ast.AST):
    """The nodes of ``scope`` outside the functions defined in it (each is a scope of its own)."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        if isinstance(node, FUNCTIONS):
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


def bare_mpirun_launches(source: str, name: str = "<source>") -> list[str]:
    """``file:line`` of each subprocess call in ``source`` that starts an mpirun command not
    passed through ``fresh_session``."""
    tree = ast.parse(source)
    found = []
    scopes = [n for n in ast.walk(tree) if isinstance(n, FUNCTIONS)] + [tree]
    for scope in scopes:
        nodes = list(_own_nodes(scope))
        # Names this scope assigns an mpirun command to (cmd = [MPIRUN, ...]).
        built: set[str] = set()
        for node in nodes:
            if isinstance(node, ast.Assign) and _mentions_mpirun(node.value, built):
                built |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        for node in nodes:
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if not (
                isinstance(func, ast.Attribute)
                and func.attr in SUBPROCESS_CALLS
                and isinstance(func.value, ast.Name)
                and func.value.id == "subprocess"
            ):
                continue
            command = (
                node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "args"), None)
            )
            if command is None or _called(command) == "fresh_session":
                continue
            if _mentions_mpirun(command, built):
                found.append(f"{name}:{node.lineno}")
    return sorted(set(found))


def test_no_test_or_benchmark_starts_mpirun_without_a_fresh_session():
    files = sorted([*(REPO / "tests").rglob("*.py"), *(REPO / "benchmarks").glob("*.py")])
    assert len(files) > 50  # the scan really reads the suite
    bare = [hit for f in files for hit in bare_mpirun_launches(f.read_text(), str(f.relative_to(REPO)))]
    assert bare == [], (
        "mpirun started without session_dirs.fresh_session (exit 213 after a pid reuse): " + ", ".join(bare)
    )


def test_the_scan_finds_a_bare_launch_and_passes_a_fresh_one():
    bare = (
        "import subprocess\n"
        "def start(out):\n"
        "    cmd = [MPIRUN, '-n', '2']\n"
        "    cmd += ['python', 'w.py']\n"
        "    return subprocess.Popen(cmd, start_new_session=True)\n"
        "def run(p):\n"
        "    subprocess.run(mpirun_command(2, p), check=True)\n"
    )
    assert bare_mpirun_launches(bare) == ["<source>:5", "<source>:7"]
    fresh = bare.replace("Popen(cmd,", "Popen(fresh_session(cmd),").replace(
        "run(mpirun_command(2, p)", "run(fresh_session(mpirun_command(2, p))"
    )
    assert bare_mpirun_launches(fresh) == []
    other = "import subprocess\ndef f(cmd):\n    subprocess.run(['sh', '-c', 'x', *cmd])\n"
    assert bare_mpirun_launches(other) == []
    # A name is an mpirun command only in the function that builds it as one.
    two = "import subprocess\ndef a():\n    cmd = [MPIRUN]\ndef b():\n    cmd = ['ls']\n    subprocess.run(cmd)\n"
    assert bare_mpirun_launches(two) == []
