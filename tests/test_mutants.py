"""The mutation check's own mechanics (bench/mutants.py), on a synthetic tree: a snippet
that moved or repeats stops it by the mutant's name, a mutant never lands as a syntax
error, and the likely catchers run first. The check itself: `python -m bench.mutants`."""

from __future__ import annotations

import pytest

from bench.mutants import MUTANTS, SELF_TEST, Edit, Mutant, MutantError, apply, mutated_sources, ordered_test_files


def tree(tmp_path, text="def f(x):\n    if x:\n        return 1\n    return 0\n"):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(text)
    return tmp_path


def mutant(*edits):
    return Mutant("planted", "a test mutant", tuple(edits), ())


def test_a_mutant_is_applied_exactly(tmp_path):
    root = tree(tmp_path)
    apply(root, mutant(Edit("pkg/m.py", "        return 1\n", "        return 2\n"), Edit("pkg/m.py", "return 0", "return 3")))
    assert (root / "pkg" / "m.py").read_text() == "def f(x):\n    if x:\n        return 2\n    return 3\n"


@pytest.mark.parametrize("old,found", [("return 7", 0), ("return", 2)])
def test_a_snippet_not_found_exactly_once_stops_the_check_by_name(tmp_path, old, found):
    root = tree(tmp_path)
    with pytest.raises(MutantError, match=f"mutant planted: snippet found {found} times in pkg/m.py"):
        apply(root, mutant(Edit("pkg/m.py", old, "return 9")))
    assert "return 9" not in (root / "pkg" / "m.py").read_text()  # nothing written


def test_a_mutant_that_would_not_compile_is_refused(tmp_path):
    with pytest.raises(MutantError, match="mutant planted: the mutated pkg/m.py does not compile"):
        mutated_sources(tree(tmp_path), mutant(Edit("pkg/m.py", "    if x:\n", "    if x\n")))


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(MutantError, match="mutant planted: pkg/gone.py does not exist"):
        mutated_sources(tree(tmp_path), mutant(Edit("pkg/gone.py", "x", "y")))


def test_likely_catchers_run_first_then_every_other_test_file(tmp_path):
    (tmp_path / "tests").mkdir()
    for name in ("test_a.py", "test_b.py", "test_c.py", SELF_TEST, "conftest.py"):
        (tmp_path / "tests" / name).write_text("")
    assert ordered_test_files(tmp_path, ("tests/test_c.py", "tests/test_gone.py")) == ["tests/test_c.py", "tests/test_a.py", "tests/test_b.py"]


def test_the_mutants_are_distinct_and_each_changes_something():
    assert len({m.name for m in MUTANTS}) == len(MUTANTS) >= 6
    for m in MUTANTS:
        assert m.edits and all(edit.old != edit.new for edit in m.edits), m.name
        assert all(catcher.startswith("tests/test_") for catcher in m.catchers), m.name
