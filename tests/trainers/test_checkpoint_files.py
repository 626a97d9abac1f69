"""The checkpoint module's functions on small hand-made checkpoints: every way a checkpoint can fail to verify
is named in its own line, damaged checkpoints set aside keep distinct names, a crash while deleting an old one
leaves only what the next save removes, and the messages of a failed write give the sizes a user needs. The
trainer-level cases (resume falls back, a full disk mid-run, kills) are in ``test_checkpoint_integrity.py``."""

import json
import os
import pickle
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from cohortrl.trainers import checkpoint

MANIFEST = checkpoint.MANIFEST
DiskUsage = namedtuple("DiskUsage", "total used free")  # what shutil.disk_usage returns


def saved(run: Path, step: int = 1, **save) -> Path:
    return checkpoint.save(run, step, {"model": {"w": torch.arange(4.0) * step}, "note": "x"}, **save)


# ---------------------------------------------------------------------------------------------- deleting
def test_a_crash_while_deleting_an_old_checkpoint_leaves_only_what_the_next_save_removes(tmp_path, monkeypatch):
    """The old checkpoint is renamed into a ``.tmp-old-*`` directory beside it before its files go: a crash
    before they are gone (here: the removal does nothing) leaves no ``step_*`` directory with some of its files,
    and the next save clears it."""
    saved(tmp_path, 1)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", lambda *args, **kwargs: None)
    saved(tmp_path, 2, keep=1)
    left = sorted(p.name for p in checkpoint.checkpoint_dir(tmp_path).iterdir())
    assert left[1:] == ["step_000002"] and left[0].startswith(".tmp-old-"), left
    assert (checkpoint.checkpoint_dir(tmp_path) / left[0] / "step_000001" / MANIFEST).is_file()
    monkeypatch.undo()
    saved(tmp_path, 3, keep=1)
    assert [p.name for p in checkpoint.checkpoint_dir(tmp_path).iterdir()] == ["step_000003"]


# ---------------------------------------------------------------------------------------------- setting aside
def test_damaged_checkpoints_set_aside_keep_distinct_names(tmp_path):
    """The same step damaged again after an earlier resume gets ``.1``, ``.2``: nothing set aside is overwritten."""
    moved = []
    for step in (1, 1, 1):
        path = saved(tmp_path, step)
        moved += checkpoint.set_aside([path])
    rejected = checkpoint.checkpoint_dir(tmp_path) / checkpoint.REJECTED
    assert moved == [rejected / "step_000001", rejected / "step_000001.1", rejected / "step_000001.2"]
    assert all((p / MANIFEST).is_file() for p in moved) and checkpoint.step_dirs(tmp_path) == []


def test_a_damaged_checkpoint_that_cannot_be_moved_is_named_with_the_fix(tmp_path):
    path = saved(tmp_path, 2)
    (checkpoint.checkpoint_dir(tmp_path) / checkpoint.REJECTED).write_text("a file where the directory goes")
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.set_aside([path])
    target = checkpoint.checkpoint_dir(tmp_path) / "rejected" / "step_000002"
    assert str(err.value) == (f"could not move the damaged checkpoint {path} to {target} (File exists); "
                              "move or delete it by hand, then resume again")
    assert err.value.__cause__ is None and err.value.__suppress_context__
    assert checkpoint.verify(path) is None  # left where it was


# ---------------------------------------------------------------------------------------------- verifying
def rewrite_manifest(path: Path, change) -> None:
    manifest = json.loads((path / MANIFEST).read_text())
    change(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))


def test_an_intact_checkpoint_verifies_with_and_without_its_config_hash(tmp_path):
    path = saved(tmp_path, 3, config_hash="abc123")
    assert path == tmp_path / "checkpoints" / "step_000003"  # the layout users and docs/reliability.md rely on
    assert checkpoint.verify(path) is None and checkpoint.verify(path, "abc123") is None
    manifest = json.loads((path / MANIFEST).read_text())
    assert (manifest["format"], manifest["step"], manifest["config_hash"]) == (1, 3, "abc123")
    assert json.loads((saved(tmp_path / "b", 1) / MANIFEST).read_text())["config_hash"] == ""  # none given
    assert sorted(manifest["files"]) == ["model.safetensors", "state.pt"]
    for name, entry in manifest["files"].items():
        assert entry["size"] == (path / name).stat().st_size and len(entry["sha256"]) == 64
    assert checkpoint.load(path)["note"] == "x" and checkpoint.load(path)["step"] == 3


@pytest.mark.parametrize("change, problem", [
    (lambda m: m.pop("step"), "'step' missing or not a int"),
    (lambda m: m.update(step="3"), "'step' missing or not a int"),
    (lambda m: m.pop("cohortrl_version"), "'cohortrl_version' missing or not a str"),
    (lambda m: m.update(config_hash=None), "'config_hash' missing or not a str"),
    (lambda m: m.update(files=[]), "'files' missing or not a dict"),
    (lambda m: m["files"].update({"/etc/passwd": {"size": 1, "sha256": "0"}}), "bad entry for '/etc/passwd'"),
    (lambda m: m["files"].update({"../x": {"size": 1, "sha256": "0"}}), "bad entry for '../x'"),
    (lambda m: m["files"].update({"x": "0"}), "bad entry for 'x'"),
    (lambda m: m["files"].update({"x": {"size": "1", "sha256": "0"}}), "bad entry for 'x'"),
    (lambda m: m["files"].update({"x": {"size": 1, "sha256": 0}}), "bad entry for 'x'"),
    (lambda m: m["files"].update({"x": {"sha256": "0"}}), "bad entry for 'x'"),
])
def test_an_incomplete_manifest_is_named_with_what_is_wrong(tmp_path, change, problem):
    path = saved(tmp_path, 3)
    rewrite_manifest(path, change)
    assert checkpoint.verify(path) == f"{path / MANIFEST}: incomplete ({problem})"


def test_each_other_problem_is_named_in_one_line(tmp_path):
    path = saved(tmp_path, 3, config_hash="abc123def456xyz")
    manifest = path / MANIFEST
    assert checkpoint.verify(path, "0123456789abcdef") == (
        f"{manifest}: written under another config (hash abc123def456, this run's is 0123456789ab): copied from "
        "another run?")

    moved = path.parent / "step_000004"
    path.rename(moved)
    assert checkpoint.verify(moved) == (
        f"{moved / MANIFEST}: says step 3, the directory is step 4 (renamed or copied into place)")
    assert checkpoint.verify(moved.rename(tmp_path / "copy_00004")) is None  # not named step_*: any step

    path = saved(tmp_path / "b", 3)
    (path / "extra.txt").write_text("added")
    assert checkpoint.verify(path) == f"{path / 'extra.txt'}: not in the manifest (added after the checkpoint was written)"
    (path / "extra.txt").unlink()
    (path / "sub").mkdir()
    (path / "sub" / MANIFEST).write_text("{}")  # only the top-level manifest is the manifest
    assert checkpoint.verify(path) == f"{path / 'sub' / MANIFEST}: not in the manifest (added after the checkpoint was written)"
    shutil.rmtree(path / "sub")

    data = (path / "state.pt").read_bytes()
    (path / "state.pt").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert checkpoint.verify(path) == (f"{path / 'state.pt'}: SHA-256 differs from the manifest (changed after it was "
                                       "written: bit rot, a bad copy or an edit)")
    (path / "state.pt").write_bytes(data + b"\0")
    assert checkpoint.verify(path) == (f"{path / 'state.pt'}: {len(data) + 1} bytes, the manifest says {len(data)} "
                                       "(truncated or overwritten)")
    (path / "state.pt").unlink()
    assert checkpoint.verify(path) == f"{path / 'state.pt'}: missing (listed in the manifest)"
    (path / "state.pt").mkdir()  # the size the manifest expects, but no file to read
    rewrite_manifest(path, lambda m: m["files"]["state.pt"].update(size=(path / "state.pt").stat().st_size))
    assert checkpoint.verify(path).startswith(f"{path / 'state.pt'}: unreadable (Is a directory")

    manifest = path / MANIFEST
    manifest.write_text("[1, 2")
    assert checkpoint.verify(path).startswith(f"{manifest}: unreadable (Expecting")
    manifest.write_text("[1, 2]")
    assert checkpoint.verify(path) == f"{manifest}: incomplete (not a JSON object)"
    manifest.unlink()
    assert checkpoint.verify(path) == f"{path}: no {MANIFEST}, which is written last: the write or a copy of it did not finish"


def test_the_newest_intact_checkpoint_is_found_past_damaged_newer_ones(tmp_path):
    for step in (1, 2, 3, 4):
        saved(tmp_path, step, keep=0, config_hash="mine")
    (checkpoint.checkpoint_dir(tmp_path) / "step_000004" / MANIFEST).unlink()
    rewrite_manifest(checkpoint.checkpoint_dir(tmp_path) / "step_000003", lambda m: m.update(config_hash="other"))
    for name in ("step_9", "step_10", "step_x1"):  # by number 9 and 10 are the newest; "step_x1" is no step
        (checkpoint.checkpoint_dir(tmp_path) / name).mkdir()
    (checkpoint.checkpoint_dir(tmp_path) / "step_000011").write_text("a file, not a checkpoint")
    found = checkpoint.find_intact(tmp_path, config_hash="")
    assert found.path == checkpoint.checkpoint_dir(tmp_path) / "step_000003"  # no hash asked: any config
    found = checkpoint.find_intact(tmp_path, config_hash="mine")
    assert found.path == checkpoint.checkpoint_dir(tmp_path) / "step_000002"
    assert [p.name for p, _ in found.rejected] == ["step_10", "step_9", "step_000004", "step_000003"]
    assert checkpoint.latest(tmp_path) == checkpoint.checkpoint_dir(tmp_path) / "step_000003"
    assert [p.name for p in checkpoint.step_dirs(tmp_path)] == ["step_000001", "step_000002", "step_000003",
                                                                "step_000004", "step_9", "step_10"]


# ---------------------------------------------------------------------------------------------- writing
def test_a_checkpoint_gets_an_ordinary_directorys_mode_and_a_rewrite_replaces_it_whole(tmp_path):
    old = os.umask(0o027)
    try:
        path = saved(tmp_path, 1)
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o750  # not mkdtemp's 0700
    (path / "stale.txt").write_text("from before")
    checkpoint.write_dir(path, lambda tmp: (tmp / "new.txt").write_text("new"), step=1)
    assert sorted(p.name for p in path.iterdir()) == [MANIFEST, "new.txt"] and checkpoint.verify(path) is None
    assert sorted(p.name for p in path.parent.iterdir()) == ["step_000001"]  # the old contents' .tmp-old-* gone


def test_a_failed_rename_puts_the_old_contents_back(tmp_path, monkeypatch):
    path = saved(tmp_path, 1)
    real = os.replace

    def replace(src, dst):
        if Path(src).name.startswith(".tmp-step_000001-"):
            raise OSError(18, "Invalid cross-device link")
        return real(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", replace)
    with pytest.raises(checkpoint.CheckpointError, match=r"could not write .*step_000001: \[Errno 18\] Invalid cross-device link"):
        checkpoint.write_dir(path, lambda tmp: (tmp / "new.txt").write_text("new"), step=1)
    monkeypatch.undo()
    assert checkpoint.verify(path) is None and (path / "model.safetensors").is_file()
    left = sorted(p.name for p in path.parent.iterdir())  # the emptied holder of the old contents, beside them
    assert left[1:] == ["step_000001"] and left[0].startswith(".tmp-old-step_000001-"), left
    checkpoint.write_dir(path, lambda tmp: None, step=1)  # the next write of that directory removes it
    assert sorted(p.name for p in path.parent.iterdir()) == ["step_000001"]


def test_a_crash_between_the_two_renames_leaves_the_old_contents_where_the_next_write_removes_them(tmp_path, monkeypatch):
    path = saved(tmp_path, 1)
    real = os.replace

    def replace(src, dst):
        if Path(src).name.startswith(".tmp-step_000001-"):
            raise SystemExit("killed")  # not an OSError: nothing puts the old contents back
        return real(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", replace)
    with pytest.raises(SystemExit):
        checkpoint.write_dir(path, lambda tmp: None, step=1)
    monkeypatch.undo()
    (left,) = path.parent.iterdir()  # no step_000001 at all, never a mix
    assert left.name.startswith(".tmp-old-step_000001-") and checkpoint.verify(left / "step_000001") is None
    checkpoint.write_dir(path, lambda tmp: None, step=1)
    assert [p.name for p in path.parent.iterdir()] == ["step_000001"]


def test_ctrl_c_inside_a_handled_os_error_stays_ctrl_c(tmp_path):
    """A KeyboardInterrupt that lands while a library handles an OSError of its own (Path.mkdir(exist_ok=True)
    on an existing directory) carries that error as its context; it is an interrupt, not a failed write."""
    def write(tmp):
        try:
            raise FileExistsError(17, "File exists", str(tmp))
        except FileExistsError:
            raise KeyboardInterrupt  # what Ctrl-C raises, wherever the main thread is

    with pytest.raises(KeyboardInterrupt) as raised:
        checkpoint.write_dir(tmp_path / "step_000001", write, step=1)
    assert isinstance(raised.value.__context__, FileExistsError)  # the case: the context is an OS error
    assert list(tmp_path.iterdir()) == []  # the temporary directory is gone too


def test_leftovers_of_an_interrupted_write_are_removed_by_the_next(tmp_path):
    path = saved(tmp_path, 1)
    for name in (".tmp-step_000002-abc", ".tmp-old-step_000002-def", ".tmp-old-xyz"):
        (path.parent / name).mkdir()
        (path.parent / name / "half.bin").write_bytes(b"\0")
    other = path.parent.parent / "final"
    (path.parent.parent / ".tmp-final-abc").mkdir()  # another directory's leftover: a write of final/ removes it
    saved(tmp_path, 2)
    assert sorted(p.name for p in path.parent.iterdir()) == ["step_000001", "step_000002"]
    checkpoint.write_dir(other, lambda tmp: None, step=2)
    assert not (path.parent.parent / ".tmp-final-abc").exists() and checkpoint.verify(other) is None


def test_a_file_named_as_the_manifest_in_the_contents_is_refused(tmp_path):
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.write_dir(tmp_path / "final", lambda tmp: (tmp / MANIFEST).write_text("{}"), step=1)
    assert str(err.value).startswith(f"{tmp_path}/.tmp-final-") and str(err.value).endswith(
        f"/{MANIFEST}: written by the checkpoint's contents; that name is the manifest's")
    assert list(tmp_path.iterdir()) == []


def test_an_old_checkpoint_that_cannot_be_deleted_is_warned_about_and_the_new_one_kept(tmp_path, monkeypatch, caplog):
    saved(tmp_path, 1)

    def discard(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(checkpoint, "_discard", discard)
    with caplog.at_level("WARNING", logger="cohortrl"):
        saved(tmp_path, 2, keep=1)
    old = checkpoint.checkpoint_dir(tmp_path) / "step_000001"
    assert [r.getMessage() for r in caplog.records] == [
        f"could not delete the old checkpoint {old} (Permission denied); delete it by hand"]
    assert [p.name for p in checkpoint.step_dirs(tmp_path)] == ["step_000001", "step_000002"]


def test_a_leftover_that_cannot_be_removed_is_left_for_a_later_write_without_a_word(tmp_path, monkeypatch, caplog):
    """Removing a ``.tmp-*`` directory can fail (files of another user, a read-only mount). Each leftover is
    only space, retried by the next write: no save fails or warns over one. The stand-in for ``rmtree`` fails
    as the real one does on such a tree: it raises unless told to ignore errors, and removes nothing."""
    def cannot_remove(path, ignore_errors=False, **kwargs):
        if not ignore_errors:
            raise PermissionError(13, "Permission denied", str(path))

    saved(tmp_path, 1)
    checkpoints = checkpoint.checkpoint_dir(tmp_path)
    (checkpoints / ".tmp-crashed").mkdir()  # swept by save
    (checkpoints / ".tmp-step_000002-crashed").mkdir()  # swept by write_dir
    monkeypatch.setattr(checkpoint.shutil, "rmtree", cannot_remove)
    with caplog.at_level("WARNING", logger="cohortrl"):
        saved(tmp_path, 2, keep=1)  # the sweeps, then step 1 discarded: renamed aside, its removal fails
        saved(tmp_path, 2, keep=1)  # step 2 again: swap_in sets the old step 2 aside, its removal fails
        with pytest.raises(checkpoint.CheckpointError, match="No space left on device"):  # the failed write's own error
            checkpoint.write_dir(tmp_path / "final", lambda tmp: _raise(OSError(28, "No space left on device")), step=2)
    assert caplog.records == []
    assert [p.name for p in checkpoint.step_dirs(tmp_path)] == ["step_000002"]
    assert checkpoint.verify(checkpoints / "step_000002") is None
    assert len(list(checkpoints.glob(".tmp-*"))) == 4 and len(list(tmp_path.glob(".tmp-final-*"))) == 1


def _raise(error: BaseException):
    raise error


@pytest.mark.parametrize("free, per_copy, said", [
    (2 * 1536, 1536, None),  # exactly room for two
    (2 * 1536 - 1, 1536, "3.0 KB free, less than 2 checkpoints (about 1.5 KB each) need"),
    (1023, 5 * 2**20, "1023 B free, less than 2 checkpoints (about 5.0 MB each) need"),
    (3 * 2**30 + 2**29, 2**31, "3.5 GB free, less than 2 checkpoints (about 2.0 GB each) need"),
    (1024, 3 * 2**40, "1.0 KB free, less than 2 checkpoints (about 3072.0 GB each) need"),
    (2**20 - 1, 2**20, "1024.0 KB free, less than 2 checkpoints (about 1.0 MB each) need"),
])
def test_the_space_warning_gives_free_and_needed_space_in_readable_units(tmp_path, monkeypatch, free, per_copy, said):
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: DiskUsage(10**13, 0, free))
    warning = checkpoint.space_warning(tmp_path, per_copy)
    assert warning == (None if said is None else f"{tmp_path} has {said}: a checkpoint write may fail with a full "
                       "disk; free space or use another --run-dir")


def test_the_space_warning_reads_the_real_filesystem(tmp_path):
    assert checkpoint.space_warning(tmp_path, 1) is None  # two bytes are free here
    assert checkpoint.space_warning(tmp_path, 2**62).startswith(f"{tmp_path} has ")


def test_a_failed_write_without_an_estimate_or_free_space_says_so(tmp_path, monkeypatch):
    def write(tmp):
        raise OSError(5, "Input/output error", str(tmp / "model.safetensors"))

    def no_usage(path):
        raise OSError(2, "No such file or directory")

    monkeypatch.setattr(checkpoint.shutil, "disk_usage", no_usage)
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.write_dir(tmp_path / "final", write, step=1)
    assert str(err.value) == (f"could not write {tmp_path / 'final' / 'model.safetensors'}: [Errno 5] Input/output "
                              "error (free space unknown on that filesystem); nothing partial was left behind")


@pytest.mark.parametrize("own_writer", [True, False])
def test_an_os_error_without_a_number_is_given_in_its_own_words(tmp_path, own_writer):
    def fail(path):
        raise OSError("quota exceeded")

    def write(tmp):  # through the module's own writer, which names the file, or a library's
        checkpoint._write_file(tmp / "model.safetensors", fail) if own_writer else fail(tmp / "model.safetensors")

    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.write_dir(tmp_path / "final", write, step=1, needed_bytes=2048)
    what = tmp_path / "final" / ("model.safetensors" if own_writer else "")
    assert str(err.value).startswith(f"could not write {what}: quota exceeded (needs about 2.0 KB, ")


# ---------------------------------------------------------------------------------------------- reading
def test_a_manifest_the_os_cannot_read_is_named_with_the_reason(tmp_path, monkeypatch):
    path = saved(tmp_path, 1)
    real = Path.read_text

    def read_text(self, *args, **kwargs):
        if self.name == MANIFEST:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    assert checkpoint.verify(path) == f"{path / MANIFEST}: unreadable (Permission denied)"


def test_an_unreadable_weights_file_is_named_not_loaded(tmp_path):
    path = saved(tmp_path, 1)
    (path / "model.safetensors").write_bytes(b"not safetensors")  # damaged after verification, or never verified
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.load(path)
    assert str(err.value) == f"could not read {path / 'model.safetensors'}: Error while deserializing header: header too large"
    assert err.value.__suppress_context__


@pytest.mark.parametrize("data, reason", [
    (b"not a torch file", "torch.load could not unpickle it (Unsupported operand 110)"),  # no pickle, no refused object
    (b"", "EOFError: the file ends too early"),
    (b"PK\x03\x04" + bytes(100), "PytorchStreamReader failed reading zip archive: "),
])
def test_an_unreadable_state_file_is_named_not_loaded(tmp_path, data, reason):
    path = saved(tmp_path, 1)
    (path / "state.pt").write_bytes(data)
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.load(path)
    assert str(err.value).startswith(f"could not read {path / 'state.pt'}: {reason}")
    assert "\n" not in str(err.value) and err.value.__suppress_context__


def test_an_unpickling_error_of_one_line_is_its_own_reason(tmp_path, monkeypatch):
    """torch 2.4-2.13 wrap every unpickling error in a paragraph about ``weights_only``; an error that comes
    unwrapped (plain pickle's, as another torch might pass on) is quoted whole, and an empty one said so."""
    path = saved(tmp_path, 1)

    def unwrapped(*args, **kwargs):
        raise pickle.UnpicklingError("invalid load key, 'x'.")

    monkeypatch.setattr(checkpoint.torch, "load", unwrapped)
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.load(path)
    assert str(err.value) == f"could not read {path / 'state.pt'}: torch.load could not unpickle it (invalid load key, 'x'.)"
    monkeypatch.setattr(checkpoint.torch, "load", lambda *args, **kwargs: _raise(pickle.UnpicklingError()))
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.load(path)
    assert str(err.value) == f"could not read {path / 'state.pt'}: torch.load could not unpickle it (torch gave no reason)"


def test_a_state_file_that_needs_a_module_imported_first_is_named_with_torchs_reason(tmp_path):
    """torch puts this reason on the first line, before its advice about ``weights_only``. A fresh process,
    because a nested jagged tensor loads once ``torch._dynamo`` has been imported by anything."""
    path = saved(tmp_path, 1)
    torch.save({"x": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)}, path / "state.pt")
    code = "import sys; from cohortrl.trainers import checkpoint\ntry: checkpoint.load(sys.argv[1])\nexcept checkpoint.CheckpointError as e: print(e)"
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True).stdout
    assert out == (f"could not read {path / 'state.pt'}: torch.load could not unpickle it (``torch.nested`` and "
                   "``torch._dynamo`` must be imported to load nested jagged tensors (NJTs))\n")


def test_the_size_estimate_counts_every_tensor_in_the_nest():
    state = {"a": [torch.ones(2), (torch.ones(3, dtype=torch.float64), "text")], "b": 5, "c": {"d": torch.ones(1, dtype=torch.int8)}}
    assert checkpoint.tensor_bytes(state) == 2 * 4 + 3 * 8 + 1


def test_files_a_library_wrote_reach_the_disk_before_the_manifest_and_verifying_syncs_nothing(tmp_path, monkeypatch):
    """final/ is written by save_pretrained, not through the module's own writer: the manifest's hashing syncs
    each file it vouches for. Reading a checkpoint back writes nothing, so it syncs nothing."""
    synced, real = [], os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(checkpoint.os, "fsync", fsync)
    path = checkpoint.write_dir(tmp_path / "final", lambda tmp: (tmp / "weights.bin").write_bytes(b"w"), step=1)
    written = [Path(p).name for p in synced]
    assert written.index("weights.bin") < written.index(MANIFEST)
    assert json.loads((path / MANIFEST).read_text())["config_hash"] == ""  # none given
    synced.clear()
    assert checkpoint.verify(path) is None and synced == []


def test_a_pickled_object_torch_does_not_allow_is_refused_quoting_torchs_reason(tmp_path):
    """Not code, but not tensors or plain data either: refused, with torch's own line on it rather than its
    general paragraph about ``weights_only`` (the hostile-pickle case is in ``test_reliability.py``)."""
    from fractions import Fraction

    path = saved(tmp_path, 1)
    torch.save({"step": 1, "x": Fraction(1, 3)}, path / "state.pt")
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.load(path)
    assert str(err.value).startswith(
        f"refusing to load {path / 'state.pt'}: it holds pickled Python objects other than tensors and plain data, "
        "which could run code when loaded (torch.load weights_only=True said: Unsupported global: GLOBAL "
        "fractions.Fraction was not an allowed global by default.")
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------- RNG states
def test_the_gpus_rng_states_are_checkpointed_and_restored(tmp_path, monkeypatch):
    """On a GPU machine (mocked: two GPUs whose generator states are byte tensors) each GPU's generator state is
    written with the checkpoint and set back on resume, through state.pt's safe load; resumed on a machine with
    one GPU, that GPU gets its state back; a checkpoint without GPU states (written on a CPU) sets none."""
    gpus = [torch.arange(8, dtype=torch.uint8), torch.arange(8, 16, dtype=torch.uint8)]
    restored = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [g.clone() for g in gpus])
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.__setitem__(device, state.clone()))
    path = checkpoint.save(tmp_path, 1, {"rng": checkpoint.rng_state()})
    checkpoint.set_rng_state(checkpoint.load(path)["rng"])
    assert sorted(restored) == [0, 1] and all(torch.equal(restored[i], gpus[i]) for i in (0, 1))
    restored.clear()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    checkpoint.set_rng_state(checkpoint.load(path)["rng"])
    assert sorted(restored) == [0] and torch.equal(restored[0], gpus[0])
    restored.clear()
    cpu_only = {k: v for k, v in checkpoint.load(path)["rng"].items() if k != "cuda"}
    checkpoint.set_rng_state(cpu_only)
    assert restored == {}
