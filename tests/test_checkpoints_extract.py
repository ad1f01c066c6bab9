"""Safe extraction of downloaded checkpoint archives: nothing may land outside the target."""
import io
import tarfile

import pytest

import tinker_checkpoints


def make_archive(path, entries):
    """entries: (name, kind, payload) with kind file|symlink|hardlink|fifo."""
    with tarfile.open(path, "w:gz") as tar:
        for name, kind, payload in entries:
            info = tarfile.TarInfo(name)
            if kind == "file":
                data = payload.encode()
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                info.type = {"symlink": tarfile.SYMTYPE, "hardlink": tarfile.LNKTYPE, "fifo": tarfile.FIFOTYPE}[kind]
                info.linkname = payload or ""
                tar.addfile(info)
    return path


def every_file(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def sandbox(tmp_path):
    """tmp_path/outside is where an attack would write; tmp_path/target is the export folder."""
    (tmp_path / "outside").mkdir()
    return tmp_path


GOOD = ("adapter_config.json", "file", '{"r": 8}')


@pytest.mark.parametrize("bad_entry, reason", [
    (("/tmp/evil_abs_tinker_checkpoints.txt", "file", "x"), "absolute path"),
    (("../outside/evil.txt", "file", "x"), "leaves the target"),
    (("sub/../../outside/evil.txt", "file", "x"), "leaves the target"),
    (("link", "symlink", "../outside"), "points outside"),
    (("abs_link", "symlink", "/etc/passwd"), "points outside"),
    (("hard", "hardlink", "../outside/victim.txt"), "points outside"),
    (("pipe", "fifo", None), "device or FIFO"),
])
def test_unsafe_archive_is_refused_and_nothing_is_written(sandbox, bad_entry, reason):
    # The safe entry comes first: a refusal must still write nothing at all.
    archive = make_archive(sandbox / "ckpt.tar.gz", [GOOD, bad_entry, ("after.txt", "file", "y")])
    target = sandbox / "target"
    with pytest.raises(tinker_checkpoints.UnsafeArchive, match=reason) as info:
        tinker_checkpoints.safe_extract(archive, target)
    assert info.value.exit_code == 1
    assert not target.exists()
    assert every_file(sandbox / "outside") == []
    assert not (sandbox.parent / "evil.txt").exists()


def test_symlink_followed_by_write_through_it_is_refused(sandbox):
    archive = make_archive(sandbox / "ckpt.tar.gz", [("d", "symlink", str(sandbox / "outside")),
                                                     ("d/evil.txt", "file", "x")])
    with pytest.raises(tinker_checkpoints.UnsafeArchive):
        tinker_checkpoints.safe_extract(archive, sandbox / "target")
    assert every_file(sandbox / "outside") == []


def test_safe_archive_extracts_with_inward_links(sandbox):
    archive = make_archive(sandbox / "ckpt.tar.gz", [
        GOOD, ("weights/adapter_model.safetensors", "file", "W"), ("latest", "symlink", "weights")])
    target = sandbox / "target"
    files = tinker_checkpoints.safe_extract(archive, target)
    assert files == ["adapter_config.json", "weights/adapter_model.safetensors"]
    assert (target / "adapter_config.json").read_text() == '{"r": 8}'
    assert (target / "latest" / "adapter_model.safetensors").read_text() == "W"
    assert every_file(sandbox / "outside") == []
