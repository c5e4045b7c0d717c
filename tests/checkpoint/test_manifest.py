"""The checkpoint manifest: sizes and XXH3-128 hashes (format 2), older SHA-256 manifests (format 1) still checked."""
from __future__ import annotations

import hashlib
import json

import pytest
import xxhash

from mrl.checkpoint import manifest


def _files(d):
    (d / "a.distcp").write_bytes(bytes(range(256)) * 100)
    (d / "rng").mkdir()
    (d / "rng" / "rank_00000.pt").write_bytes(b"rng state")
    return {rel: manifest.file_entry(d / rel) for rel in manifest.listed_files(d)}


def test_a_save_lists_each_file_with_its_size_and_xxh3_128(tmp_path):
    files = _files(tmp_path)
    data = (tmp_path / "a.distcp").read_bytes()
    assert files["a.distcp"] == {"bytes": len(data), "xxh3_128": xxhash.xxh3_128_hexdigest(data)}
    manifest.write(tmp_path, files, step=3, optimizer=True)
    body = manifest.read(tmp_path)
    assert body["format"] == 2 and body["files"] == files and body["step"] == 3
    assert manifest.problem_in(tmp_path, files) is None


def test_a_changed_byte_or_size_is_named(tmp_path):
    files = _files(tmp_path)
    raw = bytearray((tmp_path / "a.distcp").read_bytes())
    raw[12345] ^= 0x01
    (tmp_path / "a.distcp").write_bytes(raw)
    assert manifest.problem_in(tmp_path, files) == "a.distcp does not match its checksum (its bytes changed after the save)"
    (tmp_path / "rng" / "rank_00000.pt").write_bytes(b"rng")
    assert manifest.problem_in(tmp_path, {k: v for k, v in files.items() if k.startswith("rng")}) == (
        "rng/rank_00000.pt is truncated: 3 bytes, the manifest says 9")


def test_an_older_sha256_manifest_is_still_read_and_checked(tmp_path):
    _files(tmp_path)
    old = {rel: manifest.file_entry(tmp_path / rel, "sha256") for rel in manifest.listed_files(tmp_path)}
    assert old["a.distcp"]["sha256"] == hashlib.sha256((tmp_path / "a.distcp").read_bytes()).hexdigest()
    manifest.write(tmp_path, old, step=1, optimizer=False)
    body = manifest.read(tmp_path)
    assert body["format"] == 1
    assert manifest.problem_in(tmp_path, body["files"]) is None
    (tmp_path / "a.distcp").write_bytes(b"\xff" + (tmp_path / "a.distcp").read_bytes()[1:])
    assert "does not match its checksum" in manifest.problem_in(tmp_path, body["files"])


def test_a_manifest_whose_entries_lack_its_formats_hash_is_refused(tmp_path):
    (tmp_path / manifest.MANIFEST).write_text(json.dumps(
        {"format": 2, "step": 1, "optimizer": False, "files": {"a": {"bytes": 1, "sha256": "00"}}}))
    with pytest.raises(manifest.ManifestError, match="not an mrl checkpoint manifest"):
        manifest.read(tmp_path)
