"""The package's import graph (issue 35): every `import` of a mok_jax module by another, at module level or inside
a function, read from the source. It has no circle: the last one, config <-> workspace, went when MoEConfig stopped
holding the workspace (it is passed beside the config now), and any new one fails here."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "mok_jax"
# circles allowed: none
KNOWN_CIRCLES: list[set[str]] = []


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for p in PACKAGE.rglob("*.py"):
        name = ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = p
    return mods


def _graph(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                           for a in node.names]
            else:
                continue
            for t in targets:
                r = resolve(t) if t.split(".")[0] == "mok_jax" else None
                if r and r != m:
                    graph[m].add(r)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        comp.add(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        out.append(comp)
            elif w not in index:
                index[w] = low[w] = counter
                counter += 1
                stack.append(w)
                on.add(w)
                work.append((w, iter(sorted(graph[w]))))
            elif w in on:
                low[v] = min(low[v], index[w])
    return out


def test_the_package_has_no_import_circle():
    circles = _circles(_graph(_modules()))
    assert sorted(map(sorted, circles)) == sorted(map(sorted, KNOWN_CIRCLES)), circles


def test_the_graph_reader_finds_a_circle():
    # the check above can fail: a made-up graph with one circle and a tail
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_the_reference_and_the_bench_sit_where_they_should():
    graph = _graph(_modules())
    reach = {}

    def below(m):
        if m not in reach:
            reach[m] = set()
            for n in graph[m]:
                reach[m] |= {n} | below(n)
        return reach[m]

    # the pure-JAX oracle depends on nothing it checks, and the package never imports its benchmarks
    assert not {n for n in below("mok_jax.reference") if n.startswith(("mok_jax.ops", "mok_jax.layer"))}
    assert not {m for m in graph if not m.startswith("mok_jax.bench") and any(
        n.startswith("mok_jax.bench") for n in graph[m])}
