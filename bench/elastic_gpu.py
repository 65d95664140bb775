"""Elastic resume on the device: ImageLoader + ResNet-50 on 2 GPUs, SIGKILL, resume on 1 GPU, then on 2.

    python bench/elastic_gpu.py --out $OUT                       # 2 GPUs (NCCL), ~4k images
    python bench/elastic_gpu.py --device cpu --quick --out DIR   # the same on CPU (gloo), tiny

Phase A (torchrun, 2 processes) trains; at step ``--save-a`` every rank calls
``loader.global_state_dict()`` (a collective) and rank 0 saves it with the model; the job trains on
until the driver SIGKILLs the whole torchrun job. Phase B (1 process) loads that state, trains
``--steps-b`` steps, saves the global state and exits. Phase C (2 processes) loads it and trains
to the end of the epoch. Labels are the sample keys (every sample identifiable; the loss uses
them modulo 1000). Check: what was delivered up to each checkpoint plus phase C is the epoch,
every sample, with at most one repeat per 2-rank plan (``world_size - 1``). Writes
``elastic_gpu.json`` and ``elastic_gpu.log`` under ``--out``.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


# ---- one rank (under torchrun) -------------------------------------------------------------------
def rank_main(args) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from datapipe import expand_urls
    from loaders import ImageLoader

    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    with open(os.path.join(args.out, f"pid_{args.phase}_{rank}"), "w") as f:
        f.write(str(os.getpid()))
    urls = expand_urls(os.path.join(args.data, "shard-{000000..%06d}.tar" % (args.shards - 1)))
    loader = ImageLoader(urls, batch_size=args.batch_size, image_size=args.image_size, train=True, drop_last=False,
                         device=device, shuffle_buffer=args.shuffle_buffer, seed=7, reader="stream",
                         label_key="__key__", label_decoder=int, num_threads=args.threads)
    model = None
    if args.model == "resnet50":
        try:
            import torchvision

            model = torchvision.models.resnet50(weights=None)
        except ImportError:
            pass
    if model is None:  # no torchvision (CPU check): a small CNN with the same input and loss
        model = nn.Sequential(nn.Conv2d(3, 16, 3, stride=4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                              nn.Linear(16, 1000))
    model = model.to(device, memory_format=torch.channels_last)
    if args.resume:
        saved = torch.load(args.resume, weights_only=False, map_location="cpu")
        model.load_state_dict(saved["model"])
        loader.load_state_dict(saved["loader"])
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    log = open(os.path.join(args.out, f"ids_{args.phase}_{rank}.txt"), "w")
    step = 0
    for x, y in loader:
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = loss_fn(ddp(x.contiguous(memory_format=torch.channels_last)), y % 1000)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        log.write(f"{step} " + " ".join(map(str, y.tolist())) + "\n")
        log.flush()
        if step == args.save_at:
            state = loader.global_state_dict()  # collective: every rank, the same step
            if rank == 0:
                tmp = args.save + ".tmp"
                torch.save({"loader": state, "model": model.state_dict(), "step": step}, tmp)
                os.replace(tmp, args.save)
            if args.exit_after_save:
                break
        if step >= args.save_at > 0:
            time.sleep(args.pause_after_save)  # phase A: the kill lands mid-epoch
    log.write("DONE\n")
    log.close()
    if args.wait_at_end:  # phase A: hold on until the driver kills the job
        time.sleep(600)
    dist.barrier()
    dist.destroy_process_group()


# ---- the driver ----------------------------------------------------------------------------------
def _torchrun(args, procs: int, phase: str, extra: list[str], logf):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc_per_node",
           str(procs), os.path.abspath(__file__), "--rank-main", "--phase", phase, "--device", args.device,
           "--out", args.out, "--data", args.data, "--shards", str(args.shards_n), "--batch-size",
           str(args.batch_size), "--image-size", str(args.image_size), "--shuffle-buffer", str(args.shuffle_buffer),
           "--threads", str(args.threads), "--model", args.model] + extra
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    logf.write(f"$ {' '.join(cmd)}\n")
    logf.flush()
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)


def _steps(path: str) -> list[tuple[int, list[int]]]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                if line.endswith("\n") and line[0].isdigit():
                    step, *ids = line.split()
                    out.append((int(step), [int(i) for i in ids]))
    except FileNotFoundError:
        pass
    return out


def _wait(proc, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        raise SystemExit(f"{what}: timed out after {timeout} s")
    if rc != 0:
        raise SystemExit(f"{what}: torchrun exit status {rc} (see elastic_gpu.log)")
    return time.monotonic() - t0


def _kill_job(proc, out: str, phase: str, ranks: int) -> None:
    """SIGKILL the torchrun job: its process group, then any rank that left it."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    for r in range(ranks):
        try:
            with open(os.path.join(out, f"pid_{phase}_{r}")) as f:
                pid = int(f.read())
            os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError, ValueError):
            pass


def driver(args) -> dict:
    import torch

    from bench.common import write_result
    from datapipe.tools.synthetic import make_image_dataset

    os.makedirs(args.out, exist_ok=True)
    logf = open(os.path.join(args.out, "elastic_gpu.log"), "a")
    t_start = time.monotonic()
    shutil.rmtree(args.data, ignore_errors=True)  # deterministic: the same images every run
    info = make_image_dataset(args.data, num_images=args.images, num_classes=1000, seed=3,
                              shard_max_count=args.shard_size, size=(args.src_size, args.src_size * 3 // 4),
                              progress=False, num_workers=max(1, min(16, os.cpu_count() or 1)))
    args.shards_n = len(info["shards"])
    gen_s = time.monotonic() - t_start
    ck_a, ck_b = os.path.join(args.out, "elastic_a.pt"), os.path.join(args.out, "elastic_b.pt")
    for p in (ck_a, ck_b):
        if os.path.exists(p):
            os.remove(p)
    phases = {}

    # A: 2 ranks, global state at save_a, killed a few steps later
    t0 = time.monotonic()
    a = _torchrun(args, 2, "A", ["--save-at", str(args.save_a), "--save", ck_a, "--wait-at-end",
                                 "--pause-after-save", str(args.pause_after_save)], logf)
    try:
        deadline = time.monotonic() + args.phase_timeout
        while not (os.path.exists(ck_a) and all(
                len(_steps(os.path.join(args.out, f"ids_A_{r}.txt"))) >= args.save_a + args.past for r in range(2))):
            if a.poll() is not None:
                raise SystemExit(f"phase A: torchrun exited early with status {a.returncode} (see elastic_gpu.log)")
            if time.monotonic() > deadline:
                raise SystemExit("phase A: no checkpoint in time")
            time.sleep(0.05)
    finally:
        if a.poll() is None:
            _kill_job(a, args.out, "A", 2)
    a_logged = [_steps(os.path.join(args.out, f"ids_A_{r}.txt")) for r in range(2)]
    mid_epoch = not any("DONE" in open(os.path.join(args.out, f"ids_A_{r}.txt")).read() for r in range(2))
    phases["A"] = {"world_size": 2, "saved_at_step": args.save_a, "steps_logged_when_killed": [len(s) for s in a_logged],
                   "killed": "SIGKILL of the torchrun job", "killed_mid_epoch": mid_epoch, "seconds": round(time.monotonic() - t0, 1)}
    before = [i for s in a_logged for step, ids in s if step <= args.save_a for i in ids]

    # B: 1 rank from A's global state, global state again after steps_b steps
    t0 = time.monotonic()
    b = _torchrun(args, 1, "B", ["--resume", ck_a, "--save-at", str(args.steps_b), "--save", ck_b,
                                 "--exit-after-save"], logf)
    _wait(b, args.phase_timeout, "phase B")
    b_logged = _steps(os.path.join(args.out, "ids_B_0.txt"))
    middle = [i for step, ids in b_logged if step <= args.steps_b for i in ids]
    phases["B"] = {"world_size": 1, "resumed_from": torch.load(ck_a, weights_only=False)["loader"]["world_size"],
                   "steps": len(b_logged), "seconds": round(time.monotonic() - t0, 1)}

    # C: 2 ranks from B's global state, to the end of the epoch
    t0 = time.monotonic()
    c = _torchrun(args, 2, "C", ["--resume", ck_b], logf)
    _wait(c, args.phase_timeout, "phase C")
    c_logged = [_steps(os.path.join(args.out, f"ids_C_{r}.txt")) for r in range(2)]
    after = [i for s in c_logged for _, ids in s for i in ids]
    phases["C"] = {"world_size": 2, "steps_per_rank": [len(s) for s in c_logged],
                   "samples_per_rank": [sum(len(ids) for _, ids in s) for s in c_logged],
                   "seconds": round(time.monotonic() - t0, 1)}

    seen = collections.Counter(before + middle + after)
    missing = sorted(set(range(args.images)) - set(seen))
    extra = sorted(set(seen) - set(range(args.images)))
    repeats = sum(n - 1 for n in seen.values())
    allowed = (2 - 1) + (1 - 1) + (2 - 1)  # world_size - 1 per plan: A, B's replan, C's replan
    ok = (mid_epoch and not missing and not extra and repeats <= allowed
          and len(set(phases["C"]["samples_per_rank"])) == 1 and len(set(phases["C"]["steps_per_rank"])) == 1)
    result = {"ok": ok, "images": args.images, "delivered": {"before_A_checkpoint": len(before),
                                                             "B_until_its_checkpoint": len(middle), "C": len(after)},
              "missing": missing[:20], "missing_count": len(missing), "unknown": extra[:20], "repeats": repeats,
              "repeats_allowed": allowed, "phases": phases, "device": args.device, "model": args.model,
              "batch_size_per_rank": args.batch_size, "image_size": args.image_size,
              "shuffle_buffer": args.shuffle_buffer, "dataset_seconds": round(gen_s, 1),
              "total_seconds": round(time.monotonic() - t_start, 1)}
    path = write_result("elastic_gpu", result, args.out)
    logf.write(json.dumps(result, indent=1) + "\n")
    logf.close()
    print(json.dumps(result, indent=1))
    print("wrote", path)
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "bench", "results"))
    p.add_argument("--data", default="/tmp/datapipe-elastic-images")
    p.add_argument("--images", type=int, default=4096)
    p.add_argument("--shard-size", type=int, default=256)
    p.add_argument("--src-size", type=int, default=256, help="width of the generated JPEGs")
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--shuffle-buffer", type=int, default=256)
    p.add_argument("--threads", type=int, default=6, help="DALI threads per rank")
    p.add_argument("--model", default="resnet50", choices=["resnet50", "small"])
    p.add_argument("--save-a", type=int, default=10, help="phase A saves the global state after this step")
    p.add_argument("--past", type=int, default=3, help="phase A trains this many steps past it before the kill")
    p.add_argument("--pause-after-save", type=float, default=0.05, help="phase A: seconds slept per step after it")
    p.add_argument("--steps-b", type=int, default=12, help="phase B steps (1 rank) before its checkpoint")
    p.add_argument("--phase-timeout", type=float, default=150)
    p.add_argument("--quick", action="store_true", help="tiny sizes for a CPU check")
    # one rank's options (the driver passes them to torchrun)
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--phase", default="A", help=argparse.SUPPRESS)
    p.add_argument("--shards", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--resume", default=None, help=argparse.SUPPRESS)
    p.add_argument("--save", default=None, help=argparse.SUPPRESS)
    p.add_argument("--save-at", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--exit-after-save", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--wait-at-end", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_main:
        rank_main(args)
        return
    if args.quick:
        args.images, args.shard_size, args.src_size, args.batch_size, args.image_size = 192, 24, 64, 8, 32
        args.shuffle_buffer, args.threads, args.model, args.save_a, args.past, args.steps_b = 16, 1, "small", 4, 2, 5
        args.pause_after_save = 0.5
        args.data += "-quick"
    result = driver(args)
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
