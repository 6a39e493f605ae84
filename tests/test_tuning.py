"""Tuned kernel tables: mok-bench --tune's grid, choice and writer, read back through mok_jax.tuning (CPU only)."""

import pytest

from mok_jax import tuning
from mok_jax.bench import accounting as acc, tune
from mok_jax.bench.report import RESULT_KEYS
from mok_jax.config import KernelConfig, load_model

KIND = "NVIDIA H200"  # a device kind; its table lies at <root>/nvidia-h200/kernel.toml

# Two problem shapes (per rank): kimi-k2's ep64-slice on 2 GPUs, and glm-5-like dimensions.
SHAPE_A = dict(hidden=7168, intermediate=2048, top_k=8, experts_per_rank=6, ep=2)
SHAPE_B = dict(hidden=6144, intermediate=2048, top_k=8, experts_per_rank=4, ep=2)


def _entry(shape, tokens, model="m", median_ms=1.0, **knobs):
    k = dict(granularity=1024, comm_items_fwd=16, comm_items_bwd=16, dispatch="pull", combine="push", ring_slots=2)
    return {"model": model, **shape, "tokens": tokens, **{**k, **knobs}, "median_ms": median_ms}


def _kernel(e):
    return KernelConfig(**{k: e[k] for k in tune.KNOBS})


@pytest.fixture
def tuned_root(tmp_path, monkeypatch):
    """mok_jax.tuning reading its tables from tmp_path only (its cache cleared before and after)."""
    monkeypatch.setattr(tuning, "_tuned_dirs", lambda: [tmp_path])
    tuning.load_table.cache_clear()
    yield tmp_path
    tuning.load_table.cache_clear()


def test_grid():
    g = tune.grid(2048)
    assert len(g) == 3 * 4 * 2  # granularity 4096 clipped to 2048, deduplicated
    assert sorted({s["granularity"] for s in g}) == [512, 1024, 2048]
    assert {s["comm_items_fwd"] for s in g} == {16, 24, 32, 48} and {s["ring_slots"] for s in g} == {2, 3}
    assert {s["comm_items_fwd"] for s in g} >= {tuning.HEURISTIC_COMM_ITEMS}  # the tuner can find the heuristic
    assert all(s["comm_items_bwd"] == s["comm_items_fwd"] and (s["dispatch"], s["combine"]) == ("pull", "push")
               for s in g)
    assert len({tuple(sorted(s.items())) for s in g}) == len(g)  # no duplicates
    assert sorted({s["granularity"] for s in tune.grid(8192)}) == [512, 1024, 2048, 4096]
    assert {s["granularity"] for s in tune.grid(100)} == {512}  # the kernel's smallest microbatch
    assert sorted({s["granularity"] for s in tune.grid(3000)}) == [512, 1024, 2048, 3008]  # one microbatch: 3000
    for tokens in (100, 3000, 8192):
        for s in tune.grid(tokens):
            KernelConfig(**s)  # every setting is a valid config


def test_write_then_read_back_and_resolve(tuned_root):
    path = tuning.table_path(KIND, root=tuned_root)
    assert path == tuned_root / "nvidia-h200" / "kernel.toml"
    entries = [_entry(SHAPE_A, 8192, granularity=4096, ring_slots=3), _entry(SHAPE_B, 2048, comm_items_fwd=24),
               _entry(SHAPE_A, 1024, granularity=512, comm_items_fwd=8)]
    written = tune.write_table(path, entries, commit="abc1234", date="2027-01-02")
    text = path.read_text()
    assert text.splitlines()[0] == "# written by mok-bench --tune on 2027-01-02, commit abc1234"
    assert text.count("\n[[entry]]\n") == 3
    # sorted by problem: shape B (hidden 6144) first, then A at 1024 and 8192 tokens
    assert [(e["hidden"], e["tokens"]) for e in written] == [(6144, 2048), (7168, 1024), (7168, 8192)]

    table = tuning.load_table(str(path))
    assert [(k.hidden, k.tokens) for k, _ in table] == [(6144, 2048), (7168, 1024), (7168, 8192)]
    assert [c for _, c in table] == [_kernel(e) for e in written]
    assert tune.read_entries(path)[0]["model"] == "m" and tune.read_entries(path)[0]["median_ms"] == 1.0

    key = lambda shape, tokens: tuning.ProblemKey(**shape, tokens=tokens)
    # nearest token count in log scale: 4096 is one doubling from 8192, two from 1024
    assert tuning.resolve(None, key(SHAPE_A, 4096), KIND) == _kernel(entries[0])
    assert tuning.resolve(None, key(SHAPE_A, 1500), KIND) == _kernel(entries[2])
    assert tuning.resolve(None, key(SHAPE_A, 65536), KIND) == _kernel(entries[0])
    # another shape (2 experts per rank): no entry, the heuristic
    other = key({**SHAPE_A, "experts_per_rank": 2}, 4096)
    assert tuning.resolve(None, other, KIND) == tuning.heuristic(other)
    assert tuning.resolve(None, key(SHAPE_A, 4096), "NVIDIA B200") == tuning.heuristic(key(SHAPE_A, 4096))
    # the heuristic: one microbatch up to 4096 tokens at EP 1, 2048 above (at least 512, whole 64-token chunks),
    # 32 items, 2 slots
    ep1, ep8 = ({**SHAPE_A, "ep": ep} for ep in (1, 8))
    heur = {t: tuning.heuristic(key(ep1, t)) for t in (100, 2048, 3000, 4096, 8192, 65536)}
    assert {t: k.granularity for t, k in heur.items()} == {100: 512, 2048: 2048, 3000: 3008, 4096: 4096,
                                                          8192: 4096, 65536: 4096}
    assert [tuning.heuristic(key(ep8, t)).granularity for t in (100, 2048, 3000, 8192)] == [512, 2048, 2048, 2048]
    assert all((k.comm_items_fwd, k.comm_items_bwd, k.ring_slots) == (32, 32, 2) for k in heur.values())
    # an explicit KernelConfig wins over the table
    explicit = KernelConfig(granularity=2048, comm_items_fwd=4, ring_slots=1)
    assert tuning.resolve(explicit, key(SHAPE_A, 8192), KIND) is explicit


def test_update_replaces_same_problem_and_keeps_others(tuned_root):
    path = tuning.table_path(KIND, root=tuned_root)
    tune.write_table(path, [_entry(SHAPE_A, 1024, median_ms=2.0), _entry(SHAPE_B, 2048, model="b")], commit="old")
    new = _entry(SHAPE_A, 1024, granularity=512, ring_slots=3, median_ms=1.5, model="a")
    tune.write_table(path, [new, _entry(SHAPE_A, 256, granularity=512)], commit="new", dirty=True, date="2027-02-03")
    assert path.read_text().splitlines()[0] == ("# written by mok-bench --tune on 2027-02-03, commit new "
                                                "(with uncommitted changes)")
    entries = tune.read_entries(path)
    assert [(e["hidden"], e["tokens"], e["model"]) for e in entries] == [(6144, 2048, "b"), (7168, 256, "m"),
                                                                          (7168, 1024, "a")]
    assert entries[2]["median_ms"] == 1.5 and _kernel(entries[2]) == _kernel(new)
    assert tuning.resolve(None, tuning.ProblemKey(**SHAPE_A, tokens=1024), KIND) == _kernel(new)


def test_write_rejects_bad_entries_and_keeps_the_file(tuned_root):
    path = tuning.table_path(KIND, root=tuned_root)
    tune.write_table(path, [_entry(SHAPE_A, 1024)], commit="c")
    before = path.read_text()
    with pytest.raises(ValueError, match="granularity"):
        tune.write_table(path, [_entry(SHAPE_A, 2048, granularity=500)], commit="c")
    with pytest.raises(ValueError, match="unknown keys"):
        tune.write_table(path, [{**_entry(SHAPE_A, 2048), "speed": 3}], commit="c")
    with pytest.raises(ValueError, match="lacks"):
        tune.write_table(path, [{k: v for k, v in _entry(SHAPE_A, 2048).items() if k != "ep"}], commit="c")
    old = {("comm_sms_fwd" if k == "comm_items_fwd" else k): v for k, v in _entry(SHAPE_A, 2048).items()}
    with pytest.raises(ValueError, match="comm_sms_fwd is now comm_items_fwd"):
        tune.write_table(path, [old], commit="c")
    assert path.read_text() == before


def test_a_table_with_the_knob_names_before_issue_35_is_refused_naming_the_new_ones(tuned_root):
    """A tuned table's comm_sms_fwd / comm_sms_bwd key raises a ValueError that names the entry and the new field
    (comm_items_fwd / comm_items_bwd), not a bare "unknown keys"."""
    path = tuning.table_path(KIND, root=tuned_root)
    tune.write_table(path, [_entry(SHAPE_A, 1024)], commit="c")
    text = path.read_text()
    for old, new in (("comm_sms_fwd", "comm_items_fwd"), ("comm_sms_bwd", "comm_items_bwd")):
        path.write_text(text.replace(new, old))
        tuning.load_table.cache_clear()
        with pytest.raises(ValueError, match=rf"entry 0 has the key {old}: KernelConfig\.{old} is now {new}"):
            tuning.load_table(str(path))


def _row(model, tokens, status, median_ms=None, **knobs):
    r = dict.fromkeys(RESULT_KEYS)
    r.update(model=model, impl="mok", status=status, median_ms=median_ms, tokens_per_gpu=tokens, hidden_size=7168,
             intermediate_size=2048, top_k=8, experts_per_gpu=6, num_gpus=2,
             kernel=dict(granularity=512, comm_items_fwd=16, comm_items_bwd=16, dispatch="pull", combine="push",
                         ring_slots=2) | knobs)
    r["pass"] = "fwd"
    return r


def test_best_entries_pick_fastest_of_complete_problems():
    rows = [_row("kimi-k2", 2048, "ok", 3.0, granularity=512), _row("kimi-k2", 2048, "ok", 1.0, granularity=2048),
            _row("kimi-k2", 2048, "error"), _row("kimi-k2", 2048, "ok", 2.0, comm_items_fwd=8),
            _row("kimi-k2", 4096, "ok", 0.5), _row("kimi-k2", 4096, "skipped"),  # cut short by --time-budget
            _row("kimi-k2", 8192, "error")]  # nothing ran
    entries, incomplete = tune.best_entries(rows)
    assert incomplete == ["kimi-k2 T=4096", "kimi-k2 T=8192"]
    (e,) = entries
    assert (e["model"], e["tokens"], e["granularity"], e["median_ms"]) == ("kimi-k2", 2048, 2048, 1.0)
    assert tuning.ProblemKey(**{k: e[k] for k in tune.KEY_FIELDS}) == tuning.ProblemKey(**SHAPE_A, tokens=2048)


def test_resolve_kernel_records_what_runs(tuned_root):
    shape = acc.bench_shape(load_model("kimi-k2"), 2, "ep64-slice")
    key = tune.problem_key(shape, 2048)
    assert key == tuning.ProblemKey(**SHAPE_A, tokens=2048)  # the key mok_jax.moe builds
    # no table: the layer gets None and resolves the heuristic
    assert tune.resolve_kernel(key, None, KIND) == (None, tuning.heuristic(key), "heuristic")
    assert tune.resolve_kernel(key, None, None) == (None, tuning.heuristic(key), "heuristic")  # no GPU
    entry = _entry(SHAPE_A, 2048, granularity=512, comm_items_fwd=24, ring_slots=3)
    tune.write_table(tuning.table_path(KIND, root=tuned_root), [entry], commit="c")
    assert tune.resolve_kernel(key, None, KIND) == (None, _kernel(entry), "tuned")
    # a knob given: the others from the table, passed explicitly
    kernel, ran, source = tune.resolve_kernel(key, {"granularity": 2048}, KIND)
    assert kernel == ran == _kernel(entry).replace(granularity=2048) and source == "explicit"
