"""Synthetic conversations and a disaggregated simulation for the PD tests."""

from __future__ import annotations

from memserve.config import EngineConfig
from memserve.costmodel.store import load_cost_model
from memserve.gateway.routing.router import Router
from memserve.sim.simulator import Simulation
from memserve.sim.tokens import SyntheticTokenizer
from memserve.workload.replay import ReplayOptions
from memserve.workload.workloads import Session, Turn

BLOCK_SIZE = 16
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards",
         "quietly", "judge", "boxing", "matches"]


def conversation(i: int, turns: int, output_len: int = 40) -> Session:
    """A multi-turn session with distinct text per session and per turn."""
    def text(k: int) -> str:
        return " ".join(f"{WORDS[(i * 7 + k * 3 + j) % len(WORDS)]}{i}x{k}" for j in range(60))

    return Session(f"s{i}", tuple(Turn(user=text(k), output_len=output_len) for k in range(turns)))


def simulate(roles: list[str], mode: str, sessions: list[Session], think_time_s: float = 0.0,
             num_blocks: int = 256) -> Simulation:
    cost = load_cost_model("llama2-13b-h800")
    cfg = EngineConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, max_num_seqs=8, max_num_batched_tokens=512,
                       max_model_len=2048)
    sim = Simulation(cost, cfg, len(roles), Router.named("prompt-tree", cost), SyntheticTokenizer(),
                     ReplayOptions(rate=4.0, think_time_s=think_time_s, seed=1), roles=roles, pd_mode=mode)
    sim.run(sessions)
    return sim
