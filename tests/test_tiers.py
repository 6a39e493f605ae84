"""The tests' tiers, one per file (issue 35, item 5): a test that needs two or more GPUs lives in a
``*_multigpu.py`` file and is marked ``multigpu``; one that needs one GPU lives in a ``*_gpu.py`` file and is
marked ``gpu``; every other file runs on the CPU and holds no test marked either (nor one that asks for conftest.py's
``gpu_kernels`` gate). Checked by parsing the files (ast): nothing is imported and no GPU is needed, so the rule holds
on every machine, CI's included.

What counts as a test's marks: its decorators, its class's decorators and ``pytestmark``, and its module's
``pytestmark``; a mark is ``pytest.mark.gpu`` (called or not, in a list or tuple, or through a module-level name bound
to it). ``pytest.mark.usefixtures("gpu_kernels")`` and a ``gpu_kernels`` argument count as needing one GPU. Anywhere
else in a file (``pytest.param(..., marks=...)``, say) a gpu or multigpu mark counts as one of its tests'.
"""

from __future__ import annotations

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent
GPU_MARKS = ("gpu", "multigpu")
GPU_FIXTURES = ("gpu_kernels",)  # conftest.py's skip gate of the tests that run mok's kernels: one GPU


def tier(name: str) -> str:
    """The tier a test file's name gives it: "multigpu", "gpu" or "cpu"."""
    stem = name.removesuffix(".py")
    return "multigpu" if stem.endswith("_multigpu") else "gpu" if stem.endswith("_gpu") else "cpu"


def _mark_name(node: ast.AST) -> str | None:
    """X of ``pytest.mark.X`` or ``mark.X`` (``from pytest import mark``), else None."""
    if isinstance(node, ast.Attribute):
        owner = node.value
        if (isinstance(owner, ast.Attribute) and owner.attr == "mark") or (isinstance(owner, ast.Name)
                                                                          and owner.id == "mark"):
            return node.attr
    return None


def _needs(expr: ast.AST, aliases: dict[str, set[str]]) -> set[str]:
    """The gpu / multigpu marks of a decorator or ``pytestmark`` value; usefixtures("gpu_kernels") reads as gpu."""
    if isinstance(expr, (ast.List, ast.Tuple)):
        return set().union(*(_needs(e, aliases) for e in expr.elts))
    if isinstance(expr, ast.Name):
        return set(aliases.get(expr.id, ()))
    if isinstance(expr, ast.Call):
        name = _mark_name(expr.func)
        if name == "usefixtures":
            fixtures = {a.value for a in expr.args if isinstance(a, ast.Constant)}
            return {"gpu"} if fixtures & set(GPU_FIXTURES) else set()
        return _needs(expr.func, aliases)
    name = _mark_name(expr)
    return {name} if name in GPU_MARKS else set()


def _pytestmark(body: list[ast.stmt], aliases) -> set[str]:
    marks: set[str] = set()
    for stmt in body:
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets):
                marks |= _needs(stmt.value, aliases)
    return marks


def _aliases(tree: ast.Module) -> dict[str, set[str]]:
    """Module-level names bound to a gpu / multigpu mark (``NEEDS_GPU = pytest.mark.gpu``)."""
    out: dict[str, set[str]] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign):
            for t in stmt.targets:
                if isinstance(t, ast.Name) and t.id != "pytestmark" and (found := _needs(stmt.value, out)):
                    out[t.id] = found
    return out


def _tests(tree: ast.Module, aliases):
    """(name, line, its gpu/multigpu marks, whether it asks for a GPU fixture) of every test in the module."""
    module = _pytestmark(tree.body, aliases)

    def one(fn, inherited, prefix=""):
        marks = inherited | set().union(*(_needs(d, aliases) for d in fn.decorator_list))
        args = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
        return prefix + fn.name, fn.lineno, marks, bool(args & set(GPU_FIXTURES))

    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name.startswith("test"):
            yield one(stmt, module)
        elif isinstance(stmt, ast.ClassDef) and stmt.name.startswith("Test"):
            cls = module | _pytestmark(stmt.body, aliases) | set().union(*(_needs(d, aliases)
                                                                           for d in stmt.decorator_list))
            for fn in stmt.body:
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name.startswith("test"):
                    yield one(fn, cls, f"{stmt.name}.")


def tier_violations(name: str, source: str) -> list[str]:
    """Every way test file ``name`` with ``source`` breaks the tier rule, one line each ("file:line: why")."""
    tree = ast.parse(source, filename=name)
    aliases = _aliases(tree)
    kind = tier(name)
    out = []
    for test, line, marks, gpu_fixture in _tests(tree, aliases):
        needs = marks | ({"gpu"} if gpu_fixture else set())
        where = f"{name}:{line}: {test}"
        if kind == "cpu" and needs:
            why = f"is marked {'/'.join(sorted(marks))}" if marks else "asks for the gpu_kernels gate"
            out.append(f"{where} {why} in a CPU file: it belongs in a "
                       f"*_{'multigpu' if 'multigpu' in needs else 'gpu'}.py file")
        elif kind == "gpu" and "multigpu" in needs:
            out.append(f"{where} is marked multigpu in a one-GPU file: it belongs in a *_multigpu.py file")
        elif kind == "gpu" and "gpu" not in marks:
            out.append(f"{where} is not marked gpu in a *_gpu.py file")
        elif kind == "multigpu" and "multigpu" not in marks:
            out.append(f"{where} is not marked multigpu in a *_multigpu.py file")
    # marks outside a decorator or pytestmark (pytest.param(..., marks=...)) count as well
    allowed = {"cpu": (), "gpu": ("gpu",), "multigpu": GPU_MARKS}[kind]
    for node in ast.walk(tree):
        mark = _mark_name(node)
        if mark in GPU_MARKS and mark not in allowed:
            out.append(f"{name}:{node.lineno}: a {mark} mark in a {'CPU' if kind == 'cpu' else 'one-GPU'} file")
    return sorted(set(out), key=lambda s: (s.split(":")[0], int(s.split(":")[1])))


def test_every_test_file_keeps_its_tier():
    files = sorted(TESTS.glob("test_*.py"))
    assert len(files) > 10, f"no test files under {TESTS}?"
    bad = [v for path in files for v in tier_violations(path.name, path.read_text())]
    assert not bad, "tests outside their tier (issue 35, item 5):\n" + "\n".join(bad)


def test_the_check_sees_each_kind_of_misplaced_test():
    """The rule's checker on small sources: it flags a marked test in a CPU file (decorator, module pytestmark,
    an alias, a param's marks, the gpu_kernels fixture), an unmarked or two-GPU test in a *_gpu.py file and an
    unmarked test in a *_multigpu.py file, and passes the files as the tree writes them."""
    cpu = ("import pytest\nNEEDS = pytest.mark.gpu\n"
           "@pytest.mark.gpu\ndef test_a(): pass\n"
           "@NEEDS\ndef test_b(): pass\n"
           "def test_c(gpu_kernels): pass\n"
           "@pytest.mark.parametrize('n', [1, pytest.param(2, marks=pytest.mark.multigpu)])\ndef test_d(n): pass\n"
           "class TestE:\n    pytestmark = pytest.mark.multigpu\n    def test_f(self): pass\n"
           "def test_g(): pass\n")
    found = tier_violations("test_x.py", cpu)
    for test in ("test_a", "test_b", "test_c", "TestE.test_f"):
        assert any(f": {test} " in v and "in a CPU file" in v for v in found), (test, found)
    assert any(":8: a multigpu mark in a CPU file" in v for v in found), found
    assert not any("test_g" in v for v in found), found

    module_gpu = "import pytest\npytestmark = [pytest.mark.gpu, pytest.mark.usefixtures('gpu_kernels')]\n"
    assert tier_violations("test_x_gpu.py", module_gpu + "def test_a(): pass\n") == []
    assert tier_violations("test_x.py", module_gpu + "def test_a(): pass\n") != []
    unmarked = tier_violations("test_x_gpu.py", "import pytest\ndef test_a(): pass\n")
    assert unmarked == ["test_x_gpu.py:2: test_a is not marked gpu in a *_gpu.py file"], unmarked
    two = tier_violations("test_x_gpu.py",
                          "import pytest\n@pytest.mark.gpu\n@pytest.mark.multigpu\ndef test_a(): pass\n")
    assert any("belongs in a *_multigpu.py file" in v for v in two), two

    multi = "import pytest\npytestmark = [pytest.mark.gpu, pytest.mark.multigpu]\ndef test_a(): pass\n"
    assert tier_violations("test_x_multigpu.py", multi) == []
    assert tier_violations("test_x_multigpu.py", "import pytest\n@pytest.mark.gpu\ndef test_a(): pass\n") == [
        "test_x_multigpu.py:3: test_a is not marked multigpu in a *_multigpu.py file"]
