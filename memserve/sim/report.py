"""What a simulation reports beyond the bench's results (``results.json``'s ``simulation``
object): the run's own figures (wall and simulated time, steps, preemptions, KV
allocation, admission, the disaggregated handoffs), the hosts and the prefix pulls over
their links, the hosts lost and the requests moved off them, and the tiers' saves (blocks
dropped unsaved; the asynchronous saver's copies and the waits for them)."""

from __future__ import annotations

from typing import Any

from memserve.kvcache.address import Tier
from memserve.sim.simulator import Simulation
from memserve.workload.metrics import jct_ms, summarize, ttft_ms


def simulation_stats(sim: Simulation, wall_s: float, duration_s: float, roles: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"wall_s": round(wall_s, 3), "simulated_s": round(duration_s, 3), "steps": sim.num_steps,
                           "requests_per_wall_s": round(len(sim.records) / wall_s, 1) if wall_s else None}
    engines = [inst.engine.stats() for inst in sim.instances]
    out["preemptions"] = {kind: sum(e["preemptions"][kind] for e in engines) for kind in engines[0]["preemptions"]}
    if "kv_allocation" in engines[0]:
        out["kv_allocation"] = [e["kv_allocation"] for e in engines]
    out["admission"] = sim.admission.stats()
    if sim.pd is not None:
        out["roles"] = roles
        out["pd"] = sim.pd.stats()
    topology = sim.topology
    if topology.num_hosts > 1:
        out["hosts"] = {"count": topology.num_hosts, "instances_per_host": topology.instances_per_host,
                        "pulls": dict(sim.pulls)}
    if sim.node_loss is not None:
        out["node_loss"] = node_loss_stats(sim)
    if len(sim.instances[0].engine.mempool.tiers) > 1:
        out["tiers"] = tier_stats(sim)
    slots = [inst.runner.adapters for inst in sim.instances if inst.runner.adapters is not None]
    if slots:  # LoRA adapters read into an instance's slots, over the run
        out["lora_loads"] = sum(s.loads for s in slots)
    return out


def node_loss_stats(sim: Simulation) -> dict[str, Any]:
    """The hosts lost, the requests moved off them, and the TTFT and JCT of those requests
    against the others' (successful requests, ms)."""
    assert sim.node_loss is not None
    moved = sim.node_loss.moved
    out = sim.node_loss.stats()
    for name, records in (("moved", [r for r in sim.records if f"{r.session_id}:{r.turn}" in moved]),
                          ("others", [r for r in sim.records if f"{r.session_id}:{r.turn}" not in moved])):
        ok = [r for r in records if r.ok]
        out[name] = {"requests": len(records), "ok": len(ok),
                     "ttft_ms": summarize(v for v in map(ttft_ms, ok) if v is not None),
                     "jct_ms": summarize(v for v in map(jct_ms, ok) if v is not None)}
    return out


def tier_stats(sim: Simulation) -> dict[str, Any]:
    """Summed over the live instances: blocks dropped from a tier that has a slower one
    (``dropped_unsaved``) and, with the asynchronous saver, its copies and the waits for them."""
    live = [inst for inst in sim.instances if not inst.lost]
    dropped = {Tier(t).name.lower(): 0 for t in live[0].engine.mempool.tiers}
    for inst in live:
        io = inst.engine.mempool.stats()["tier_io"]
        for name in dropped:
            dropped[name] += io[name]["dropped_unsaved"]
    out: dict[str, Any] = {"dropped_unsaved": dropped}
    savers = [inst.runner.timed_saver for inst in live if inst.runner.timed_saver is not None]
    if savers:
        out["saver"] = {"jobs": sum(s.jobs for s in savers), "busy_s": round(sum(s.busy_s for s in savers), 3),
                        "waits": sum(s.waits for s in savers), "stall_s": round(sum(s.stall_s for s in savers), 3)}
    return out
