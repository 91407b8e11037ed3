"""``memserve up``'s flags are ServeConfig's and EngineConfig's fields (memserve/options.py):
with no flag given they build the dataclasses' own defaults, a flag reaches its field
(switches and on/off words included), and only --instances and --log-level are
declared outside the config."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from memserve.cli import _up_config, build_parser
from memserve.config import EngineConfig, ServeConfig
from memserve.options import flag_of


def _up(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["up", *argv])


def test_no_flags_give_the_config_defaults(monkeypatch):
    for name in ("MEMSERVE_CPU_THREADS_BIND", "MEMSERVE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert _up_config(_up()) == ServeConfig()


def test_flags_reach_their_fields(monkeypatch):
    monkeypatch.delenv("MEMSERVE_API_KEY", raising=False)
    cfg = _up_config(_up("--no-web-ui", "--layerwise-preload", "off", "--cache-ttl", "30", "--gpus", "0,1",
                         "--cost-model", "llama2-13b-h800", "--api-key", "k", "--cache-salt-from-key", "-q", "none"))
    assert (cfg.web_ui, cfg.engine.layerwise_preload, cfg.engine.cache_ttl_s, cfg.gpus) == (False, False, 30.0, [0, 1])
    assert cfg.cost_model == cfg.engine.cost_model == "llama2-13b-h800"
    assert (cfg.api_keys, cfg.cache_salt_from_key, cfg.engine.quantization) == (["k"], True, "none")


def test_env_default(monkeypatch):
    monkeypatch.setenv("MEMSERVE_CPU_THREADS_BIND", "0")
    assert _up().cpu_threads_bind == "0"


@pytest.mark.parametrize(("argv", "message"), [
    (["--cache-ttl", "0"], "--cache-ttl must be positive"),
    (["--cache-salt-from-key"], "--cache-salt-from-key needs --api-key"),
    (["--instances", "prefill,decode", "--cpu-workers", "3"], "--instances names 2 workers, --cpu-workers 3"),
])
def test_refused_before_anything_starts(argv, message, monkeypatch):
    monkeypatch.delenv("MEMSERVE_API_KEY", raising=False)
    with pytest.raises(ValueError, match=message):
        _up_config(_up(*argv))


def test_only_two_flags_are_declared_outside_the_config():
    up = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["up"]
    declared = {s for a in up._actions for s in a.option_strings} - {"-h", "--help"}
    from_fields = {s for cls in (EngineConfig, ServeConfig) for f in fields(cls) if (flag := flag_of(f))
                   for s in (flag.flags or ("--" + f.name.replace("_", "-"),))}
    assert declared - from_fields == {"--instances", "--log-level"}
