"""The doctor's report as text (what ``datapipe doctor`` prints): time split, per-loader wait and losses, the
ceiling, capacity and the advice."""
from __future__ import annotations

__all__ = ["format_report"]


def format_report(rep: dict) -> str:
    wall = rep["wall_s"]
    lines = [f"datapipe doctor: {rep['steps']} steps in {wall:.2f} s"
             + (f" ({rep['steps'] / wall:.1f} steps/s)" if wall > 0 else "")]
    for name in ("wait", "compute", "other"):
        label = {"wait": "data wait", "compute": "compute", "other": "other"}[name]
        lines.append(f"  {label:<10} {rep[name + '_s']:9.3f} s  {rep[name + '_fraction']:6.1%}")
    if rep.get("gpu_hold_s"):
        lines.append(f"  compute includes {rep['gpu_hold_s']:.3f} s that next() waited for the GPU's last step "
                     "(ImageLoader with few CUDA hardware queues), not for data")
    if rep["steps"]:
        lines.append(f"  per step (p50): wait {rep['wait_ms']['p50']:.2f} ms, compute {rep['compute_ms']['p50']:.2f} ms")
    if len(rep["loaders"]) > 1 or any(e["startup_wait_s"] for e in rep["loaders"]):
        for e in rep["loaders"]:
            lines.append(f"  {e['type'].rsplit('.', 1)[-1]:<12} {e['batches']:5d} batches  wait {e['wait_fraction']:6.1%}"
                         f"  (start-up {e['startup_wait_s']:.2f} s; after it {e['steady_wait_fraction']:.1%})")
    for e in rep["loaders"]:
        if rep.get("cuda") and isinstance(e.get("decoder"), dict):
            lines.append(_decoder(e["type"].rsplit(".", 1)[-1], e["decoder"], rep.get("cuda_device_max_connections"),
                                  rep.get("step")))
        if any(e.get("losses", {}).values()):
            lines.append(f"  losses: {e['type'].rsplit('.', 1)[-1]} {_losses(e['losses'])} (since it was made)")
    if rep.get("ceiling_ratio") is not None:
        lines.append(f"  loaded / data-free step rate {rep['ceiling_ratio']:.3f}: {rep['loaded_batches_per_s']:.2f} "
                     f"batches/s fed by the loader vs {rep['ceiling_batches_per_s']:.2f} with one cached batch "
                     f"replayed through the same step: {rep['ceiling_meaning']}")
    elif rep.get("ceiling_replay"):
        lines.append(f"  data-free ceiling {rep['ceiling']}")
    if rep.get("ceiling_replay"):
        lines.append(f"  note: the ceiling replay changed your run: {rep['ceiling_replay']}")
    r = rep["rates"]
    if r.get("capacity_batches_per_s"):
        lines.append(f"  input capacity {r['capacity_batches_per_s']:.1f} batches/s alone vs model consumption "
                     f"{r['consumption_batches_per_s'] or 0:.1f} batches/s")
    lines.append("advice:" if rep["advice"] else "advice: none triggered")
    lines += [f"  - {a['advice']}" for a in rep["advice"]]
    return "\n".join(lines)


_WHY = {  # DecoderChoice.stats()["why"] -> why the loader is on that decoder (or moved, for "cuda_graphs")
    "few_queues": "nvJPEG's CUDA decoder, since with {queues} hardware queues the hardware decoder stalls beside "
                  "a training step",
    "wide_queues": "{queues} hardware queues let the hardware decoder run beside the step",
    "few_cores": "too few cores for the CUDA decoder's Huffman stage",
    "set": "the decoder share you set",
    "cuda_graphs": "a CUDA-graphs step on {queues} hardware queues: the CUDA decoder keeps most of each batch, a "
                   "move gives the hardware decoder a tenth, next() waiting for the last step (docs/performance.md)",
}


def _decoder(name: str, d: dict, connections, step: str | None = None) -> str:
    """One line on an ImageLoader's JPEG decoding: the step the doctor saw, the hardware decoder's share and DALI's
    threads, why (the queues, the cores, or the user's setting), and a move (kept or taken back) if any."""
    line = (f"  decoder: {name} {d.get('hw_decoder_load', 0):.0%} of JPEGs on the hardware decoder, "
            f"{d.get('threads')} DALI threads")
    rates = " -> ".join(f"{r:g}" for r in d.get("batches_per_s") or [])
    tried = f"tried the hardware decoder after {d.get('switched_after_batches')} batches (the loop was starved)"
    trial = d.get("trial")
    if trial == "on":
        line += f"; {tried}, on trial"
    elif trial == "kept":
        line += f"; {tried} and kept it, not clearly slower there ({rates} batches/s)"
    elif trial in ("moving back", "taken back"):
        line += (f"; {tried} and {'moves' if trial == 'moving back' else 'moved'} back, slower there ({rates} "
                 "batches/s; DecodeOptions(hw_decoder_load=0.0) skips the try and its one-off seconds)")
    elif d.get("switchable") and not d.get("settled"):
        line += "; moves there by itself if the loop starves"
        bar = d.get("graphs_threshold") if step == "CUDA graphs" and d.get("graphs_threshold") else d.get("threshold")
        if d.get("starved") is not None and bar is not None:
            line += (f" (its GPU idled {d['starved']:.1%} of the last window for want of a batch; the move needs "
                     f"over {bar:.0%})")
    if step:
        line += f"; step: {step}"
    why = _WHY.get(d.get("why"))
    if why:
        line += "; why: " + why.format(queues=d.get("queues"))
    queues = connections or "unset (8 queues)"
    return line + f" (CUDA_DEVICE_MAX_CONNECTIONS {queues})"


def _losses(losses: dict) -> str:
    words = {"skipped": "samples skipped", "errors": "errors handled under on_error", "padded": "padded repeats"}
    return ", ".join(f"{n} {words[k]}" for k, n in losses.items() if n)
