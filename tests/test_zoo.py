"""Assembling GGUF files from part packages: order, hash check, atomic write."""

import hashlib
import sys
import types

import pytest

from specdecode.models import zoo


@pytest.fixture
def fake_parts(tmp_path, monkeypatch):
    """Three fake part modules (fakepart1..3) holding bytes b'p1-', b'p2-', ... ; part10-style
    ordering is covered by naming them numerically."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    data = b""
    for i in range(1, 4):
        path = tmp_path / f"part{i}.bin"
        path.write_bytes(f"p{i}-".encode() * 1000)
        data += path.read_bytes()
        module = types.ModuleType(f"fakepart{i}")
        module.get_part_path = (lambda p=path: str(p))
        monkeypatch.setitem(sys.modules, f"fakepart{i}", module)
    return data


def fake_model(data, sha=None):
    return zoo.ZooModel("fake", "fakepart{}", 3, "1.0", len(data),
                        sha or hashlib.sha256(data).hexdigest(), "fake-part{}")


def test_assembles_parts_in_order_and_checks_the_hash(fake_parts):
    messages = []
    path = zoo.assemble_gguf(fake_model(fake_parts), messages.append)
    assert path.read_bytes() == fake_parts
    assert len(messages) == 1 and "from its 3 installed parts" in messages[0]  # one line, not one per part
    assert zoo.assemble_gguf(fake_model(fake_parts)) == path  # reused, not rebuilt


def test_wrong_hash_raises_and_leaves_no_file_behind(fake_parts):
    with pytest.raises(ValueError, match="corrupt"):
        zoo.assemble_gguf(fake_model(fake_parts, sha="0" * 64))
    assert list((zoo.cache_dir() / "gguf").iterdir()) == []


def test_missing_part_package_names_what_to_install(fake_parts, monkeypatch):
    monkeypatch.delitem(sys.modules, "fakepart2")
    monkeypatch.setattr(sys, "path", [])
    with pytest.raises(FileNotFoundError, match="fake-part2==1.0"):
        zoo.assemble_gguf(fake_model(fake_parts))


def test_no_room_on_disk_says_so_before_writing(fake_parts, monkeypatch):
    import collections
    import shutil

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 100, 100))
    with pytest.raises(OSError, match=r"not enough free space .* to assemble fake: it needs .* SPECDECODE_CACHE"):
        zoo.assemble_gguf(fake_model(fake_parts))
    assert list((zoo.cache_dir() / "gguf").iterdir()) == []


def test_default_pair_is_pinned():
    assert zoo.ZOO[zoo.DEFAULT_TARGET].num_parts == 22 and zoo.ZOO[zoo.DEFAULT_DRAFT].num_parts == 6


def test_transformers_bars_and_warnings_are_off_inside_and_restored_after():
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()  # (another test's --quiet may have turned them off)
    try:
        with zoo._quiet_transformers():
            assert not hf_logging.is_progress_bar_enabled() and hf_logging.get_verbosity() == hf_logging.ERROR
        assert hf_logging.is_progress_bar_enabled() and hf_logging.get_verbosity() == verbosity
    finally:
        if not bars:
            hf_logging.disable_progress_bar()


def test_a_zoo_model_neither_installed_nor_cached_is_named_before_any_work(fake_parts, monkeypatch):
    from specdecode.models.loading import check_model_spec

    monkeypatch.setitem(zoo.ZOO, "fake", fake_model(fake_parts))
    check_model_spec("fake")  # its parts are installed
    assembled = zoo.assemble_gguf(zoo.ZOO["fake"])
    monkeypatch.delitem(sys.modules, "fakepart2")
    monkeypatch.setattr(sys, "path", [])
    check_model_spec("fake")  # a part is gone, but the file is assembled
    assembled.unlink()
    with pytest.raises(ValueError, match="fake-part2==1.0"):
        check_model_spec("fake")
