"""Jobs own their output: one job per OUT (a lock), a verified commit, re-runs that repair, clean overwrites,
workers that die with the job, and Ctrl-C that says how to resume."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import fsspec
import pytest

import datapipe.jobs.shard.commit as commit
from datapipe.errors import DataError
from datapipe.jobs.shard.lock import LOCK_NAME, LockedError, OutputLock
from tests.datapipe.jobs.shard.test_job import REPO, images, make_image_folder, run_cli, run_shard  # noqa: F401


def test_a_second_job_on_the_same_output_fails_at_once_naming_the_first(images, tmp_path, capsys):
    root, _ = images
    out = tmp_path / "out"
    with OutputLock(str(out)):  # another job holds OUT
        assert run_cli(root, out, "--workers", "1") == 1
        err = capsys.readouterr().err
        assert f"is being written by another job (pid {os.getpid()} on {socket.gethostname()} since " in err
        with pytest.raises(LockedError):
            run_shard(root, out)
    assert not (out / "manifest.json").exists() and not (out / ".datapipe-job").exists()
    assert run_cli(root, out, "--workers", "1") == 0  # released: the next job runs
    assert not (out / LOCK_NAME).exists()


def test_the_lock_of_a_killed_job_is_taken_over(images, tmp_path):
    root, files = images
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom datapipe.jobs.shard.lock import OutputLock\n"
                               f"with OutputLock({str(out)!r}):\n    print('locked', flush=True)\n    time.sleep(600)"],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(LockedError, match=f"pid {holder.pid} "):
        run_shard(root, out)
    holder.kill()
    holder.wait()
    assert (out / LOCK_NAME).exists()  # the killed job's note stays; its lock went with it
    assert run_shard(root, out)["samples"] == len(files)


def test_a_lock_on_other_storage_refuses_a_live_holder_and_takes_over_a_stale_one(images):
    root, files = images
    out = "memory://dp-lock/out"
    fs = fsspec.filesystem("memory")
    with OutputLock(out):
        with pytest.raises(LockedError, match="is being written by another job"):
            run_shard(root, out)
    assert not fs.exists("/dp-lock/out/" + LOCK_NAME)
    stale = {"pid": 1 << 22, "host": "elsewhere", "since": time.time() - 3600, "heartbeat": time.time() - 3600}
    fs.pipe_file("/dp-lock/out/" + LOCK_NAME, json.dumps(stale).encode())
    assert run_shard(root, out)["samples"] == len(files)


def test_the_commit_verifies_every_shard_before_it_writes_the_manifest(images, tmp_path, monkeypatch):
    root, files = images
    out = tmp_path / "out"
    real_move, moved = commit._move, []

    def lossy(fs, src, dst):  # as if something else deleted a shard in OUT during the commit
        real_move(fs, src, dst)
        moved.append(dst)
        if len(moved) == 2:
            fs.rm(dst)

    monkeypatch.setattr(commit, "_move", lossy)
    with pytest.raises(DataError, match=r"shard-000001.tar is missing.*Rerun the same command"):
        run_shard(root, out, max_count=5)
    assert not (out / "manifest.json").exists()
    monkeypatch.setattr(commit, "_move", real_move)
    report = run_shard(root, out, max_count=5)  # the same command rebuilds it
    assert report["status"] == "ok" and report["samples"] == len(files)
    manifest = json.load(open(out / "manifest.json"))
    assert all((out / s["name"]).stat().st_size == s["bytes"] for s in manifest["shards"])


def test_a_rerun_of_a_broken_output_rebuilds_it(images, tmp_path, caplog):
    root, files = images
    out = tmp_path / "out"
    run_shard(root, out, max_count=5)
    manifest = json.load(open(out / "manifest.json"))
    assert run_shard(root, out, max_count=5)["status"] == "already complete"
    for damage in ("missing", "changed"):
        target = out / manifest["shards"][1]["name"]
        if damage == "missing":
            target.unlink()
        else:
            data = bytearray(target.read_bytes())
            data[700] ^= 0xFF  # same size, other bytes
            target.write_bytes(bytes(data))
        caplog.clear()
        report = run_shard(root, out, max_count=5)
        assert report["status"] == "ok" and report["samples"] == len(files), damage
        assert "is broken" in caplog.text and manifest["shards"][1]["name"] in caplog.text, damage
        assert json.load(open(out / "manifest.json"))["shards"] == manifest["shards"]
        assert target.read_bytes() and commit.file_sha256(fsspec.filesystem("file"), str(target)) == \
            manifest["shards"][1]["sha256"]


def test_overwrite_with_another_pattern_removes_the_old_shards(images, tmp_path):
    root, files = images
    out = tmp_path / "out"
    run_shard(root, out, max_count=3)
    old = sorted(n for n in os.listdir(out) if n.endswith(".tar"))
    assert len(old) == 8
    with pytest.raises(ValueError, match="--overwrite"):
        run_shard(root, out, max_count=10, pattern="data-%04d.tar")
    report = run_shard(root, out, max_count=10, pattern="data-%04d.tar", overwrite=True)
    tars = sorted(n for n in os.listdir(out) if n.endswith(".tar"))
    assert tars == [f"data-{i:04d}.tar" for i in range(report["shards"])] == \
        [s["name"] for s in json.load(open(out / "manifest.json"))["shards"]]


def _children(pid):
    """Pids whose parent is ``pid`` (from /proc)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(name))
    return found


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _start_job(tmp_path, *extra):
    root = tmp_path / "imgs"
    make_image_folder(str(root), n=120, classes=("a", "b"), size=(96, 72))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "datapipe", "shard", str(root), str(out), "--resize", "40", "--max-count", "4",
           "--partition-size", "4", "--workers", "2", "--no-progress", *extra]
    proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, text=True)
    done = out / ".datapipe-job" / "done"
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if done.exists() and any(n.endswith(".json") for n in os.listdir(done)) and len(_children(proc.pid)) >= 2:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the job finished before the test could stop it"
    return proc, cmd


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_kill_9_of_the_job_leaves_no_worker_running(tmp_path):
    proc, cmd = _start_job(tmp_path)
    workers = _children(proc.pid)
    assert len(workers) >= 2
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 60
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [w for w in workers if _alive(w)], "pool workers outlived the killed job"
    assert subprocess.run(cmd, cwd=REPO, stderr=subprocess.DEVNULL).returncode == 0  # and it resumes


def test_ctrl_c_says_how_to_resume_and_exits_130(tmp_path):
    proc, cmd = _start_job(tmp_path)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert err.strip().splitlines()[-1] == "datapipe shard: interrupted: rerun the same command to resume"
    assert "Traceback" not in err
    assert subprocess.run(cmd, cwd=REPO, stderr=subprocess.DEVNULL).returncode == 0


def test_the_commit_finds_a_same_size_change_to_a_shard_this_run_wrote(images, tmp_path, monkeypatch):
    """The run's own shards are known by the stamp it gave them; a write since (same size, other bytes) is found."""
    root, files = images
    out = tmp_path / "out"
    real_move, moved = commit._move, []

    def tamper(fs, src, dst):
        real_move(fs, src, dst)
        moved.append(dst)
        if len(moved) == 2:
            data = bytearray(open(dst, "rb").read())
            data[700] ^= 0xFF
            with open(dst, "r+b") as f:  # in place: same inode, same size
                f.write(bytes(data))

    monkeypatch.setattr(commit, "_move", tamper)
    with pytest.raises(DataError, match=r"shard-000001.tar does not match the manifest's sha256"):
        run_shard(root, out, max_count=5)
    assert not (out / "manifest.json").exists()


def test_a_run_reads_back_only_the_shards_it_did_not_write(images, tmp_path, monkeypatch):
    root, files = images
    out = tmp_path / "out"
    hashed = []
    real = commit.file_sha256
    monkeypatch.setattr(commit, "file_sha256", lambda fs, p: hashed.append(p) or real(fs, p))
    report = run_shard(root, out, max_count=5)
    assert report["status"] == "ok" and hashed == []  # its own shards: stamped, unchanged
    manifest = json.load(open(out / "manifest.json"))
    entries = [dict(s, written={"run": "an earlier run", "ino": 0, "size": s["bytes"], "mtime_ns": 0})
               for s in manifest["shards"]]
    assert commit.verify_shards(str(out), entries, {}, run="this run") == []
    assert len(hashed) == len(manifest["shards"])  # another run's stamp: read back and hashed
    assert run_shard(root, out, max_count=5)["status"] == "already complete"  # the re-run reads them back too
    assert len(hashed) == 2 * len(manifest["shards"])
