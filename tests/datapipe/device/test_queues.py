import os
import subprocess
import sys

import torch

from datapipe.device.queues import HW_QUEUES, VARIABLE, widen_hardware_queues

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_set_before_cuda_starts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    env = {}
    assert widen_hardware_queues(env) is True
    assert env == {VARIABLE: str(HW_QUEUES)}


def test_the_users_value_stands(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    env = {VARIABLE: "1"}
    assert widen_hardware_queues(env) is False
    assert env == {VARIABLE: "1"}


def test_not_set_once_cuda_has_started(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    env = {}
    assert widen_hardware_queues(env) is False
    assert env == {}


def _after_import(env: dict) -> str:
    code = f"import os, loaders.images.loader; print(os.environ.get({VARIABLE!r}, 'unset'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_importing_the_image_loader_sets_it_unless_set():
    env = {k: v for k, v in os.environ.items() if k != VARIABLE}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    assert _after_import(env) == str(HW_QUEUES)
    assert _after_import({**env, VARIABLE: "8"}) == "8"
