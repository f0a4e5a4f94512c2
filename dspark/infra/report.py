"""A plan as a few readable lines (the JSON stays the record)."""

from __future__ import annotations

from dspark.infra.spec import GB


def _gb(n: float) -> str:
    return f"{n / GB:,.1f} GB"


def plan_table(plan: dict) -> str:
    lines = [f"spec {plan['spec']} ({plan['kind']})"]
    if plan["kind"] != "cluster":
        for row in plan["inference_plane"]:
            where = f" {row['address']} netns {row['netns']}" if row["netns"] else ""
            lines.append(f"  extract  on {row['node']}{where}")
        for row in plan["training_plane"]:
            where = f" {row['address']} netns {row['netns']}" if row["netns"] else ""
            lines.append(f"  train    on {row['node']}{where} x{row['processes']}")
        return "\n".join(lines)
    t, inf, st, tr = plan["target"], plan["inference"], plan["stream"], plan["training"]
    lines.append(
        f"  target   {t['name']}: {t['num_layers']} layers, hidden {t['hidden_size']}, "
        f"vocab {t['vocab_size']}, weights {_gb(t['weight_bytes'])}"
    )
    for inst in inf["instances"]:
        stages = ", ".join(
            f"{s['node']} GPUs {s['gpus'][0]}-{s['gpus'][-1]} layers {s['layers'][0]}-"
            f"{s['layers'][1]}"
            for s in inst["stages"]
        )
        lines.append(
            f"  instance {inst['instance']}: TP{inst['tensor_parallel']} x "
            f"PP{inst['pipeline_parallel']}: {stages}"
        )
    g = inf["per_gpu"]
    lines.append(
        f"  per GPU  weights {_gb(g['weights_bytes'])} + KV {_gb(g['kv_bytes'])} "
        f"({plan['longest_sample_tokens']:,} tokens) = {_gb(g['total_bytes'])} of "
        f"{_gb(inf['usable_per_gpu_bytes'])} usable"
    )
    lines.append(f"  why      {inf['why']}")
    lines.append(
        f"  stream   {st['protocol']}: {_gb(st['sample_bytes'])} per longest sample x "
        f"{st['max_in_flight']} in flight = {_gb(st['segment_bytes_per_inference_node'])} "
        "per inference node"
    )
    p = tr["per_gpu"]
    lines.append(
        f"  train    {', '.join(tr['nodes'])} x{tr['world_size']} ({tr['backend']}, DDP): "
        f"draft state {_gb(p['draft_state_bytes'])} + sample {_gb(p['sample_bytes'])} + "
        f"lm_head {_gb(p['lm_head_bytes'])} = {_gb(p['total_bytes'])} per GPU"
    )
    for c in plan["checks"]:
        mark = "ok  " if c["ok"] else "FAIL"
        lines.append(f"  {mark}     {c['name']}: {_gb(c['need_bytes'])} of {_gb(c['have_bytes'])}")
    return "\n".join(lines)
