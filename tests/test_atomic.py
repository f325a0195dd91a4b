"""One atomic write (``sakura.atomic``): whole file or the old one, no temporary file
left, and no module renames a temporary file of its own outside the listed exceptions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from sakura.atomic import write_atomic

ROOT = Path(__file__).resolve().parents[1]

# writes that keep their own temp-then-rename, with the reason (sakura/atomic.py docstring)
OWN_RENAMES = {
    "sakura/atomic.py": "the rule itself (a file: write_atomic; a folder: publish_folder)",
    "codec/pack.py": "the pack streams from a spool, hashed as written, and is named by its hash",
    "cloud/storage.py": "streams a large source file in chunks",
    "dit/weights.py": "safetensors writes the file itself",
    "sakura/faults_serving.py": "plants a damaged pack on purpose",
}


def test_writes_text_and_bytes_and_leaves_no_temp(tmp_path):
    path = write_atomic(tmp_path / "a" / "f.json", '{"x": 1}')
    assert path.read_text() == '{"x": 1}'
    write_atomic(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in path.parent.iterdir()) == ["f.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    import sakura.atomic

    path = write_atomic(tmp_path / "f.txt", "old")

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sakura.atomic.os, "fsync", full_disk)  # after the bytes were written
    with pytest.raises(OSError, match="No space"):
        write_atomic(path, "new")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.txt"]


def test_no_second_copy_of_the_rule():
    renamers = set()
    for folder in ("sakura", "codec", "dit", "traces", "cloud", "edge"):
        for p in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "replace"
                        and isinstance(node.func.value, ast.Name)
                        and node.func.value.id == "os"):
                    renamers.add(str(p.relative_to(ROOT)))
    assert renamers == set(OWN_RENAMES)


def test_one_folder_fsync():
    """Folder fsyncs (what makes a rename durable) go through ``sakura.atomic.fsync_dir``:
    no other module opens a folder to fsync it (cloud/storage.py and codec/pack.py each had
    their own copy)."""
    syncing = set()  # modules that fsync a raw descriptor (a folder's), not file.fileno()
    for folder in ("sakura", "codec", "dit", "traces", "cloud", "edge"):
        for p in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "fsync" and isinstance(node.func.value, ast.Name)
                        and node.func.value.id == "os" and node.args
                        and not (isinstance(node.args[0], ast.Call)
                                 and isinstance(node.args[0].func, ast.Attribute)
                                 and node.args[0].func.attr == "fileno")):
                    syncing.add(str(p.relative_to(ROOT)))
    assert syncing == {"sakura/atomic.py"}


def test_a_folder_appears_whole_or_the_old_one_stays(tmp_path):
    from sakura.atomic import publish_folder

    def fill(text):
        def build(tmp):
            (tmp / "a.txt").write_text(text)
            (tmp / "b.txt").write_text(text)
        return build

    final = publish_folder(tmp_path / "graphs" / "g1", fill("one"))
    assert sorted(p.name for p in final.iterdir()) == ["a.txt", "b.txt"]

    def broken(tmp):
        (tmp / "a.txt").write_text("half")
        raise RuntimeError("export failed")

    with pytest.raises(RuntimeError, match="export failed"):
        publish_folder(final, broken)
    assert (final / "a.txt").read_text() == "one"  # the old folder stays
    publish_folder(final, fill("two"))  # a new one replaces it whole
    assert (final / "b.txt").read_text() == "two"
    assert sorted(p.name for p in final.parent.iterdir()) == ["g1"]  # no .build-* left


def test_a_folder_another_process_published_meanwhile_is_kept(tmp_path):
    """Two processes compile the same graph into one cache: the one that finishes second
    keeps the first one's folder when it is current (a reader of it is not pulled from
    under), and replaces it when it is not (stale or damaged)."""
    from sakura.atomic import publish_folder

    final = tmp_path / "cache" / "g1"

    def racing(marker):
        def build(tmp):
            (tmp / "graph.pte").write_text("ours")
            # meanwhile, the other process publishes its own
            final.mkdir(parents=True, exist_ok=True)
            (final / "graph.pte").write_text(marker)
        return build

    got = publish_folder(final, racing("theirs"),
                         current=lambda p: (p / "graph.pte").read_text() == "theirs")
    assert got == final and (final / "graph.pte").read_text() == "theirs"
    assert sorted(p.name for p in final.parent.iterdir()) == ["g1"]  # nothing left beside
    publish_folder(final, racing("damaged"),
                   current=lambda p: (p / "graph.pte").read_text() == "theirs")
    assert (final / "graph.pte").read_text() == "ours"  # not current: replaced whole
    assert sorted(p.name for p in final.parent.iterdir()) == ["g1"]
