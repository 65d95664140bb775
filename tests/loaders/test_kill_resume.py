"""Kill -9 mid-epoch, resume from the last checkpoint in a new process: the same batches as one uninterrupted run.

Each case runs ``kill_resume_child.py`` three times: a run the parent SIGKILLs at a seeded random
step (only the main process: its loader workers must then exit on their own), a run that loads
that run's last checkpoint and logs the rest, and an uninterrupted reference run. The logged
prefix the checkpoint covers plus the resumed batches must equal the reference exactly.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.shards import write_shards

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = os.path.join(ROOT, "tests", "loaders", "kill_resume_child.py")
PAUSE = 0.15  # the killed run sleeps this long after logging a batch and again after checkpointing it
START_TIMEOUT = 90.0  # seconds for the killed run to reach the kill step (imports, DALI build, workers)
RUN_TIMEOUT = 120.0  # seconds for a whole child run
ORPHAN_TIMEOUT = 20.0  # seconds for the killed run's workers to notice and exit (torch polls every 5 s)

# case -> (kill at: "log" = as soon as the batch is logged, before its checkpoint (the checkpoint lags
# by one); "ckpt" = once its checkpoint is written), kill-step range, worker processes expected)
CASES = {
    "dataloader": ("log", (2, 6), 2),
    "tokens": ("ckpt", (2, 6), 0),
    "images": ("log", (2, 5), 0),
    "images_workers": ("ckpt", (2, 5), 2),
    "mix": ("ckpt", (2, 6), 2),
}


def make_data(case: str, root: str) -> dict:
    os.makedirs(root, exist_ok=True)
    if case == "dataloader":
        urls, samples = write_shards(os.path.join(root, "d"), [7, 5, 9, 6])
        return {"urls": urls, "expect_keys": sorted(s["__key__"] for s in samples)}
    if case == "mix":
        a, sa = write_shards(os.path.join(root, "a"), [6, 5, 7], prefix="a")
        b, sb = write_shards(os.path.join(root, "b"), [4, 6], prefix="b")
        return {"urls_a": a, "urls_b": b, "expect_keys": sorted(s["__key__"] for s in sa + sb)}
    if case == "tokens":
        from tests.loaders.tokens.test_loader import lengths, write_token_shards

        return {"urls": write_token_shards(root, lengths(40, seed=3, high=60), per_shard=10)}
    pytest.importorskip("nvidia.dali")
    from datapipe.tools.synthetic import make_image_dataset

    info = make_image_dataset(root, num_images=36, num_classes=5, seed=2, shard_max_count=10, size=(48, 40),
                              progress=False)
    return {"urls": info["shards"], "expect_labels": list(range(36))}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    made: dict[str, dict] = {}

    def get(case: str) -> dict:
        key = "images" if case.startswith("images") else case
        if key not in made:
            made[key] = make_data(key, str(tmp_path_factory.mktemp(key)))
        return made[key]

    return get


# ---- child processes -------------------------------------------------------------------------
def child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


class Child:
    """One run of the child script in its own session (its process group id is its pid)."""

    def __init__(self, directory: str, name: str, cfg: dict):
        os.makedirs(directory, exist_ok=True)
        self.name = name
        self.log = os.path.join(directory, f"{name}.log")
        self.stderr_path = os.path.join(directory, f"{name}.stderr")
        config = os.path.join(directory, f"{name}.json")
        with open(config, "w") as f:
            json.dump({**cfg, "log": self.log}, f)
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, CHILD, config], cwd=ROOT, env=child_env(),
                                         stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        self.pgid = self.proc.pid

    def lines(self) -> list[str]:
        """The complete lines logged so far (a line cut by the kill is not counted)."""
        try:
            with open(self.log) as f:
                text = f.read()
        except FileNotFoundError:
            return []
        return text.split("\n")[:-1]

    def stderr(self) -> str:
        with open(self.stderr_path, errors="replace") as f:
            return f.read()[-3000:]

    def fail(self, what: str):
        pytest.fail(f"{self.name} child: {what}\n--- its stderr ---\n{self.stderr()}")

    def finish(self, timeout: float = RUN_TIMEOUT) -> list[str]:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_group()
            self.fail(f"did not finish within {timeout:.0f} s")
        lines = self.lines()
        if rc != 0 or not lines or lines[-1] != "DONE":
            self.fail(f"exit status {rc}, last log line {lines[-1:] or 'none'} (expected DONE)")
        return lines[:-1]

    def kill_group(self) -> None:
        if group_members(self.pgid):
            os.killpg(self.pgid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(timeout=10)


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes in process group ``pgid``, from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            out.append(int(entry))
    return out


def wait_until(condition, timeout: float, child: Child, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if child.proc.poll() is not None:
            child.fail(f"exited (status {child.proc.returncode}) before {what}; log has {len(child.lines())} lines")
        if time.monotonic() > deadline:
            child.kill_group()
            child.fail(f"no {what} within {timeout:.0f} s; log has {len(child.lines())} lines")
        time.sleep(0.005)


def checkpointed(path: str) -> int:
    """Batches the checkpoint at ``path`` covers (0 when there is none yet)."""
    if not os.path.exists(path):
        return 0
    return int(torch.load(path, weights_only=False)["batches"])


# ---- the test -----------------------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_sigkill_mid_epoch_then_resume_in_a_new_process(tmp_path, datasets, case):
    mode, (lo, hi), expect_workers = CASES[case]
    data = datasets(case)
    step = random.Random(f"kill-resume/{case}").randint(lo, hi)
    ckpt = str(tmp_path / "state.pt")
    cfg = {"case": case, **{k: v for k, v in data.items() if not k.startswith("expect")}, "ckpt": ckpt}
    runs: list[Child] = []
    try:
        killed = Child(str(tmp_path), "killed", {**cfg, "resume": False, "pause": PAUSE})
        runs.append(killed)
        reference = Child(str(tmp_path / "ref"), "reference", {**cfg, "ckpt": str(tmp_path / "ref" / "state.pt"),
                                                               "resume": False, "pause": 0.0})
        runs.append(reference)

        wait_until(lambda: len(killed.lines()) >= step, START_TIMEOUT, killed, f"batch {step} in the log")
        if mode == "ckpt":
            wait_until(lambda: checkpointed(ckpt) >= step, START_TIMEOUT, killed, f"checkpoint of batch {step}")
        workers = [p for p in group_members(killed.pgid) if p != killed.proc.pid]
        os.kill(killed.proc.pid, signal.SIGKILL)  # the main process only: its workers must notice
        killed_at = time.monotonic()
        assert killed.proc.wait(timeout=10) == -signal.SIGKILL
        assert len(workers) >= expect_workers, f"expected {expect_workers} loader worker processes, saw {workers}"

        logged = killed.lines()
        assert "DONE" not in logged, "the killed run finished its epoch before the kill: raise the data size"
        covered = checkpointed(ckpt)
        assert step - (mode == "log") <= covered <= len(logged), (step, covered, len(logged))

        resumed = Child(str(tmp_path), "resumed", {**cfg, "resume": True, "pause": 0.0})
        runs.append(resumed)
        rest = resumed.finish()
        full = reference.finish()

        assert len(full) > covered + 1, f"kill after {covered} of {len(full)} batches is not mid-epoch"
        assert logged == full[:len(logged)], "the killed run logged different batches than the reference"
        assert logged[:covered] + rest == full, (
            f"resume after {covered} batches differs from the uninterrupted run "
            f"({covered} + {len(rest)} batches vs {len(full)})")
        batches = [json.loads(line) for line in full]
        if "expect_keys" in data:
            assert sorted(k for b in batches for k in b) == data["expect_keys"]
        if "expect_labels" in data:
            assert sorted(y for b in batches for y in b["labels"]) == data["expect_labels"]

        # the killed run's worker processes exit on their own (torch's watchdog sees the parent gone)
        deadline = killed_at + ORPHAN_TIMEOUT
        while group_members(killed.pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = group_members(killed.pgid)
        assert not left, f"worker processes {left} of the killed run still alive {ORPHAN_TIMEOUT:.0f} s after the kill"
    finally:
        for run in runs:
            run.kill_group()
