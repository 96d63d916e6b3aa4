"""Output paths are checked before any work: a file, a path under a file, or an unwritable place."""

import tempfile
from pathlib import Path

import pytest

from drafttrain.errors import UserError
from drafttrain.fileio import check_output_dir


def test_new_and_existing_directories_pass(tmp_path):
    assert check_output_dir(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert check_output_dir(tmp_path) == tmp_path
    assert not (tmp_path / "a").exists()  # checking creates nothing
    assert list(tmp_path.iterdir()) == []


def test_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        check_output_dir(tmp_path / "f")
    with pytest.raises(UserError, match="lies under .* which is a file"):
        check_output_dir(tmp_path / "f" / "sub" / "dir")


def test_an_unwritable_place_is_refused(tmp_path, monkeypatch):
    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", denied)
    with pytest.raises(UserError, match="not writable .Permission denied"):
        check_output_dir(tmp_path / "out")


def test_atomic_writes_get_normal_permissions(tmp_path):
    import os

    from drafttrain.fileio import atomic_write_text

    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "r.json", "{}")
    finally:
        os.umask(old)
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == 0o644


def test_an_atomic_directory_gets_the_permissions_mkdir_and_open_would_give(tmp_path):
    """An exported model is read by serving engines that may run as another user."""
    import os

    from drafttrain.fileio import atomic_dir

    old = os.umask(0o022)
    try:
        with atomic_dir(tmp_path / "final") as d:
            fd, _ = tempfile.mkstemp(dir=d)  # 0600, like an atomic file write inside the folder
            os.close(fd)
            (d / "sub").mkdir(mode=0o700)
            (d / "run.sh").write_text("")
            os.chmod(d / "run.sh", 0o700)
    finally:
        os.umask(old)
    final = tmp_path / "final"
    assert final.stat().st_mode & 0o777 == 0o755
    assert (final / "sub").stat().st_mode & 0o777 == 0o755
    modes = sorted(p.stat().st_mode & 0o777 for p in final.iterdir() if p.is_file())
    assert modes == [0o644, 0o755]


def test_an_atomic_directory_renamed_into_place_by_another_process_first_is_theirs(tmp_path, monkeypatch):
    """Ranks generating the same cached data at once: the loser gets FileExistsError, the winner's
    copy stays whole, the loser's temporary is gone."""
    import os

    from drafttrain.fileio import atomic_dir

    target = tmp_path / "cache"
    real_replace = os.replace

    def another_process_wins(src, dst):
        if Path(dst) == target and not target.exists():
            target.mkdir()
            (target / "theirs").write_text("complete")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", another_process_wins)
    with pytest.raises(FileExistsError):
        with atomic_dir(target) as tmp:
            (tmp / "mine").write_text("complete")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]
    assert [p.name for p in target.iterdir()] == ["theirs"]
