"""step_kind: the step this thread runs (eager, compiled, CUDA graphs), read from torch's own state."""
from collections import Counter, defaultdict
from types import SimpleNamespace

import pytest

from datapipe.device.step_kind import graph_marks, step_kind


def fake_torch(initialized=True, devices=1):
    cuda = SimpleNamespace(is_initialized=lambda: initialized, device_count=lambda: devices)
    return SimpleNamespace(cuda=cuda)


def dynamo(graphs):
    counters = defaultdict(Counter)
    counters["stats"]["unique_graphs"] = graphs
    return SimpleNamespace(counters=counters)


def trees(manager):
    return SimpleNamespace(get_manager=lambda i, create_if_none_exists=True: manager)


def test_a_process_that_never_compiled_ran_eager():
    assert step_kind({}) == "eager"
    assert step_kind({"torch": fake_torch(), "torch._dynamo.utils": dynamo(0)}) == "eager"  # imported, unused


def test_graphs_captured_by_torch_compile_mean_compiled():
    assert step_kind({"torch": fake_torch(), "torch._dynamo.utils": dynamo(3)}) == "compiled"
    no_tree = {"torch": fake_torch(), "torch._dynamo.utils": dynamo(3), "torch._inductor.cudagraph_trees": trees(None)}
    assert step_kind(no_tree) == "compiled"  # mode "default": no CUDA graph tree


def test_a_cuda_graph_tree_means_cuda_graphs():
    mods = {"torch": fake_torch(), "torch._dynamo.utils": dynamo(3), "torch._inductor.cudagraph_trees": trees(object())}
    assert step_kind(mods) == "CUDA graphs"
    mods["torch"] = fake_torch(initialized=False)  # CUDA never started: no graph could have run
    assert step_kind(mods) == "compiled"


def test_since_a_mark_only_a_graph_run_after_it_reads_as_cuda_graphs():
    manager = SimpleNamespace(current_gen=4)
    mods = {"torch": fake_torch(), "torch._dynamo.utils": dynamo(3), "torch._inductor.cudagraph_trees": trees(manager)}
    mark = graph_marks(mods)
    assert mark == ((id(manager), 4),)
    assert step_kind(mods) == "CUDA graphs"  # without a mark: a tree was made, so graphs ran
    assert step_kind(mods, since=mark) == "compiled"  # none since: the step now is another (compiled here)
    manager.current_gen = 5  # replayed in a later compiled call
    assert step_kind(mods, since=mark) == "CUDA graphs"
    assert step_kind(mods, since=()) == "CUDA graphs"  # a tree made after the mark
    assert graph_marks({}) == () and step_kind({}, since=()) == "eager"
    silent = {**mods, "torch._inductor.cudagraph_trees": trees(SimpleNamespace())}  # a torch that does not say
    assert step_kind(silent, since=graph_marks(silent)) == "CUDA graphs"


@pytest.mark.gpu
def test_a_reduce_overhead_step_reads_as_cuda_graphs_in_its_own_thread_only():
    """In a process of its own (so no CUDA graph tree is left in this one's threads)."""
    import json
    import subprocess
    import sys

    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    code = """
import json, threading, torch
from datapipe.device.step_kind import graph_marks, step_kind
before = step_kind()
step = torch.compile(lambda x: (x * 2).sum(), mode="reduce-overhead")
x = torch.ones(64, device="cuda")
for _ in range(3):  # recorded, then replayed
    step(x)
torch.cuda.synchronize()
other = []
reader = threading.Thread(target=lambda: other.append(step_kind()))
reader.start()
reader.join()
mark = graph_marks()
eager = torch.ones(64, device="cuda") * 3  # an eager step: no graph runs
after_eager = step_kind(since=mark)
step(x)
print(json.dumps([before, step_kind(), other[0], after_eager, step_kind(since=mark)]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    # CUDA graph trees are per thread: another thread of the process does not run that step
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["eager", "CUDA graphs", "compiled", "compiled",
                                                                "CUDA graphs"]
